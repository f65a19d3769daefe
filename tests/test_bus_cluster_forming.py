"""A service that connects while the cluster's JetStream cannot answer (no quorum: a cluster still forming,
or two of three servers down) waits for it, rather than die at start: CI saw a replica's first stream lookup
time out 2 s after it connected, and the run stalled without a replica (tests/test_bus_cluster.py)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from e2e_utils import make_config

from rlbus.bus import Bus, Stage
from rlbus.bus import retry as retry_module
from rlbus.bus.local_cluster import LocalNatsCluster

pytestmark = pytest.mark.faults


class RetriesSeen:
    """Stands in for the retry module's logger: records each retry's request and wakes the test."""

    def __init__(self) -> None:
        self.what: list[str] = []
        self.first = asyncio.Event()

    def warning(self, event: str, **fields: Any) -> None:
        self.what.append(str(fields.get("what")))
        self.first.set()

    debug = warning


@pytest.mark.timeout(180)
async def test_a_service_opening_the_bus_without_a_jetstream_quorum_waits_for_it(
    tmp_path: Path, run_id: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen = RetriesSeen()
    monkeypatch.setattr(retry_module, "log", seen)
    with LocalNatsCluster(tmp_path / "nats", 3) as cluster:
        cfg = make_config(cluster.url, run_id, tmp_path, ["bus.replicas=3"])
        for server in cluster.servers[1:]:
            server.kill()  # one of three left: JetStream has no quorum
        opening = asyncio.ensure_future(Bus.open(cfg, name="late-replica"))
        retried = asyncio.ensure_future(seen.first.wait())
        await asyncio.wait({opening, retried}, timeout=60, return_when=asyncio.FIRST_COMPLETED)
        assert not opening.done(), f"the bus opened or failed without a quorum: {opening.exception()!r}"
        assert retried.done(), "no retry within 60 s"
        assert "ensure streams" in seen.what
        for server in cluster.servers[1:]:
            server.start()
        bus = await asyncio.wait_for(opening, 90)
        try:
            assert await bus.stream_depth(Stage.PROMPTS) == 0  # the run's streams exist
        finally:
            await bus.close()
