"""The learner's end of run against a real NATS server: a ready group whose delivery was lost on its way to
the learner (a NATS crash, a dropped connection) stays pending on the server for the learner's 600 s ack wait;
the drain makes its consumer afresh once nothing arrives, gets the group back at once, and settles it."""

from __future__ import annotations

import time
from types import SimpleNamespace

from batch_utils import ready_group

from rlbus.bus import Bus, Stage
from rlbus.learner.dispatch import Ledger
from rlbus.learner.gather import RECLAIM_AFTER_S, Gatherer
from rlbus.logs import get_logger

DURABLE = "learner"


class _EndOfRun:
    """The part of the learner a drain asks for: the ledger, settling a group, the log."""

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger
        self.ctx = SimpleNamespace(log=get_logger("test-drain"))

    async def settle(self, delivery, reason: str | None, step: int | None = None) -> None:
        self.ledger.dropped[delivery.message.scored.trajectories.work.prompt_id] = reason or ""
        await delivery.ack()


async def test_a_ready_group_lost_in_flight_comes_back_to_the_drain_at_once(bus: Bus) -> None:
    groups = [ready_group([1, 2], [[3, 4]], [1.0]), ready_group([5, 6], [[7, 8]], [0.0])]
    for g in groups:
        await bus.publish(Stage.READY, g, msg_id=g.scored.trajectories.work.prompt_id)
    ledger = Ledger()
    ledger.dispatched.update({g.scored.trajectories.work.prompt_id: i for i, g in enumerate(groups)})

    async def consumer():
        return await bus.consumer(Stage.READY, DURABLE, ack_wait_s=600)

    first = await consumer()
    got = await first.fetch(batch=2, timeout=5.0)
    assert len(got) == 2
    kept, lost = got
    ledger.trained[kept.message.scored.trajectories.work.prompt_id] = 0
    await kept.ack()  # `lost` is dropped here: handed out by the server, never seen by the learner

    async def reopen(old):
        await old.close()
        await bus.delete_consumer(Stage.READY, DURABLE)
        return await consumer()

    gatherer = Gatherer(_EndOfRun(ledger), first)  # type: ignore[arg-type]
    t0 = time.monotonic()
    await gatherer.drain(timeout_s=60.0, reopen=reopen)
    took = time.monotonic() - t0
    pid = lost.message.scored.trajectories.work.prompt_id
    assert ledger.dropped.get(pid) == "run_finished", "the lost group never came back"
    assert ledger.in_flight == 0
    assert took < RECLAIM_AFTER_S + 10, f"the drain took {took:.1f} s: it waited on the ack wait"
