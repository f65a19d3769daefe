"""The current values of a KV bucket's keys under a pattern, read through an ordered consumer of our own.

nats-py's `KeyValue.watch` (2.16) marks "no initial values" when the consumer's info shows nothing pending and
its subscription has received nothing yet. A value the server has already delivered, but the client has not
processed, counts as neither, so the marker can come first and a scan that stops at it misses that value.
`collect_status` lost the learner's heartbeat that way (test_status_plot in CI, 2026-12-07). Here the server's
own count decides: nothing delivered and nothing pending is an empty pattern; otherwise the scan reads until
the message the server sent with nothing pending after it.
"""

from __future__ import annotations

import asyncio

from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js import api as js_api
from nats.js.kv import KV_DEL, KV_OP, KV_PURGE

from rlbus.bus.connect import log


async def scan_kv(
    js: JetStreamContext, bucket: str, pattern: str, timeout_s: float, reap_s: float
) -> list[tuple[str, bytes]]:
    """(key, value) of each key of `bucket` matching `pattern` whose last operation is a put, once each;
    a scan whose next value takes longer than `timeout_s` is logged and returns what it read. The server reaps
    the consumer `reap_s` after we leave it."""
    prefix = f"$KV.{bucket}."
    arrived: asyncio.Queue[Msg] = asyncio.Queue()

    async def on_message(msg: Msg) -> None:
        await arrived.put(msg)

    sub = await js.subscribe(
        prefix + pattern,
        stream=f"KV_{bucket}",
        cb=on_message,
        ordered_consumer=True,
        deliver_policy=js_api.DeliverPolicy.LAST_PER_SUBJECT,
        inactive_threshold=reap_s,
    )
    try:
        info = await sub.consumer_info()
        if info.num_pending == 0 and (info.delivered is None or not info.delivered.consumer_seq):
            return []  # the server has nothing to send
        found: dict[str, bytes] = {}  # a key written again during the scan keeps its newest value only
        while True:
            try:
                msg = await asyncio.wait_for(arrived.get(), timeout_s)
            except TimeoutError:
                log.warning("bus.kv_scan_timeout", pattern=pattern, found=len(found))
                return list(found.items())
            key = msg.subject[len(prefix) :]
            removed = msg.headers is not None and msg.headers.get(KV_OP) in (KV_DEL, KV_PURGE)
            if msg.data and not removed:
                found[key] = msg.data
            else:
                found.pop(key, None)
            if msg.metadata.num_pending == 0:
                return list(found.items())
    finally:
        await sub.unsubscribe()
