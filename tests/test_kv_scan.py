"""`scan_kv` against a real NATS server: the current values under a pattern, deletes and purges left out, an
empty pattern answered at once; the server's own delivered/pending counts decide when a scan is complete (the
race nats-py's watch has is in rlbus.bus.kv_scan's docstring)."""

from __future__ import annotations

import time
import uuid

import nats
from nats.js import api as js_api

from rlbus.bus.kv_scan import scan_kv


async def test_a_scan_reads_each_current_value_under_its_pattern_and_no_removed_key(nats_url: str) -> None:
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    bucket = f"rlbus_test_scan_{uuid.uuid4().hex[:8]}"
    kv = await js.create_key_value(js_api.KeyValueConfig(bucket=bucket, history=1))
    try:
        await kv.put("hb.rollout.r0", b"old")
        await kv.put("hb.rollout.r0", b"new")  # only the current value counts
        await kv.put("hb.rollout.r1", b"one")
        await kv.put("hb.rollout.r2", b"two")
        await kv.put("hb.learner.l0", b"learner")
        await kv.delete("hb.rollout.r1")
        await kv.purge("hb.rollout.r2")
        got = await scan_kv(js, bucket, "hb.rollout.>", timeout_s=5.0, reap_s=5.0)
        assert got == [("hb.rollout.r0", b"new")]
        assert await scan_kv(js, bucket, "hb.learner.>", timeout_s=5.0, reap_s=5.0) == [
            ("hb.learner.l0", b"learner")
        ]
        t0 = time.monotonic()
        assert await scan_kv(js, bucket, "hb.critic.>", timeout_s=5.0, reap_s=5.0) == []
        assert time.monotonic() - t0 < 2.5, "an empty pattern waited for its timeout"
    finally:
        await js.delete_key_value(bucket)
        await nc.close()
