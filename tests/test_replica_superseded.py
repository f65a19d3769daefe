"""A replica asks the run's state whether a newer weight push is out before joining one, but only briefly: the
learner's broadcast waits on it, and a read held up by a NATS failover once cost a push its whole timeout."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

from rlbus.config import load_config
from rlbus.messages import WeightAnnouncement, encode
from rlbus.rollout import service as rollout_service


class _Log:
    def __init__(self) -> None:
        self.lines: list[tuple[str, str]] = []

    def warning(self, event: str, **_kw: object) -> None:
        self.lines.append(("warning", event))

    def info(self, event: str, **_kw: object) -> None:
        self.lines.append(("info", event))


class _State:
    """The run's state as the replica sees it: the current announcement, or a read that never answers."""

    def __init__(self, current: bytes | None, hang: bool = False) -> None:
        self.current, self.hang = current, hang

    async def get_announcement(self) -> bytes | None:
        if self.hang:
            await asyncio.Event().wait()
        return self.current


def _announcement(epoch: int, version: int) -> bytes:
    return encode(
        WeightAnnouncement(
            run_id="r",
            version=version,
            epoch=epoch,
            master_addr="127.0.0.1",
            master_port=1,
            world_size=2,
            ranks={"rollout-0": 1},
            names=[],
            dtypes=[],
            shapes=[],
            buckets=[],
            checksum=0.0,
        )
    )


def _replica(state: _State) -> rollout_service.Replica:
    ctx = SimpleNamespace(cfg=load_config(None, []), state=state, log=_Log())
    return rollout_service.Replica(ctx, engine=None)  # type: ignore[arg-type]  # the state is all it reads here


def test_a_newer_push_supersedes_and_the_skip_is_logged() -> None:
    replica = _replica(_State(_announcement(1, 5)))
    assert asyncio.run(replica._superseded((1, 4)))
    assert ("info", "weight announcement superseded: skipped") in replica.ctx.log.lines
    assert not asyncio.run(replica._superseded((1, 5)))
    assert asyncio.run(replica._superseded((0, 9)))  # a later epoch (a re-formed group) is newer too


def test_an_older_announcement_read_back_is_a_stale_read_and_the_replica_joins() -> None:
    """After a NATS failover a read can be served by a server still catching up: the announcement it returns
    is older than the one the watch delivered, and skipping on it left the learner's broadcast waiting out its
    whole timeout (a 30 s stall in test_bus_cluster)."""
    replica = _replica(_State(_announcement(2, 51)))
    assert not asyncio.run(replica._superseded((2, 52)))
    assert not asyncio.run(replica._superseded((3, 1)))
    assert replica.ctx.log.lines == []


def test_a_read_that_does_not_answer_is_given_up_and_the_replica_joins(monkeypatch) -> None:
    monkeypatch.setattr(rollout_service, "SUPERSEDED_CHECK_S", 0.2)
    replica = _replica(_State(None, hang=True))
    t0 = time.monotonic()
    assert not asyncio.run(replica._superseded((1, 4)))
    assert time.monotonic() - t0 < 5.0
    assert ("warning", "cannot read the current weight announcement") in replica.ctx.log.lines
