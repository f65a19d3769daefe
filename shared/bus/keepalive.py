"""Work a service holds (fetched, not yet acked) is kept alive while it works on it, so the stage's ack
wait can be short: a service that dies hands its work back within seconds, whatever `bus.ack_wait_s`
the other stages use (the default is 60 s, long enough for any single step to finish)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

HELD_WORK_ACK_WAIT_S = 4.0
"""The ack wait of a stage whose consumer keeps its held work alive (bus.ack_wait_s if shorter): a killed
replica's prompts are back on the queue 2.7-4 s after its last beat, unless the learner hands them back
sooner (rlbus.bus.hand_back, at once once it knows the process is gone). Longer than a NATS outage the fault
test injects (3 s), so a restart alone hands no live replica's work to another. At 6 s, on 2026-12-06, the
heavy fault run's four rollout SIGKILLs cost 1.1-2.6 s each and the run came to 1.50x an undisturbed one."""


def held_work_ack_wait(bus_ack_wait_s: float) -> float:
    return min(bus_ack_wait_s, HELD_WORK_ACK_WAIT_S)


def keepalive_every(bus_ack_wait_s: float) -> float:
    """Three beats per ack wait: one late beat never lets the work go."""
    return held_work_ack_wait(bus_ack_wait_s) / 3


@contextlib.asynccontextmanager
async def kept_alive(deliveries: list, every_s: float) -> AsyncIterator[None]:
    """While the body runs (a generate or a scoring pass of any length), tells NATS every `every_s` that
    the deliveries are still being worked on (settled ones are skipped by `Delivery.in_progress`)."""

    async def beat() -> None:
        while True:
            await asyncio.sleep(every_s)
            for d in deliveries:
                with contextlib.suppress(Exception):  # a reconnect in progress: the next beat retries
                    await d.in_progress()

    task = asyncio.create_task(beat())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
