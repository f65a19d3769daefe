"""A replica's generation batch is filled from a burst of prompts that reach the server one by one (real NATS)."""

from __future__ import annotations

import asyncio
import time

import pytest

from rlbus.bus import Bus, Stage
from rlbus.rollout.batching import LINGER_MAX_S, fetch_batch, linger_after
from tests.test_bus import prompt


def test_linger_is_a_bounded_share_of_the_last_pass_and_none_for_cheap_passes() -> None:
    assert linger_after(0.0) == LINGER_MAX_S  # no pass yet: its cost is unknown, the first batch waits most
    assert linger_after(0.05) == 0.0  # a pass this cheap is cheaper to run twice than to wait for
    assert linger_after(0.42) == pytest.approx(0.042)  # the 0.5B shape's decode pass on an H100
    assert linger_after(30.0) == LINGER_MAX_S


async def _first_delivered(bus: Bus, durable: str, deadline_s: float = 10.0) -> None:
    """Until the server has handed the consumer its first item (the burst's first prompt was taken alone)."""
    (stream,) = bus.names.streams(Stage.PROMPTS)
    deadline = time.monotonic() + deadline_s
    while (await bus.js.consumer_info(stream, durable)).num_ack_pending < 1:
        assert time.monotonic() < deadline, "the first prompt was never delivered"
        await asyncio.sleep(0.005)


async def _fetch_during_a_burst(bus: Bus, run_id: str, linger_s: float) -> list[str]:
    """One prompt is published, the fetch takes it, and only then the other seven follow."""
    consumer = await bus.consumer(Stage.PROMPTS, "rollout")
    fetching = asyncio.create_task(fetch_batch(consumer, rows=16, widest=2, timeout=5.0, linger_s=linger_s))
    await bus.publish(Stage.PROMPTS, prompt(run_id, 0))
    await _first_delivered(bus, "rollout")
    await asyncio.gather(*(bus.publish(Stage.PROMPTS, prompt(run_id, i)) for i in range(1, 8)))
    got = await fetching
    for d in got:
        await d.ack()
    await consumer.close()  # what it left is deleted with the run's streams
    return [d.message.prompt_id for d in got]  # type: ignore[attr-defined]


async def test_a_pull_catches_a_bursts_first_prompt_alone(bus: Bus, run_id: str) -> None:
    """Why the linger exists: without it the fetch comes back with the burst's first prompt only."""
    assert await _fetch_during_a_burst(bus, run_id, linger_s=0.0) == ["p0"]


async def test_a_partial_batch_waits_for_the_rest_of_the_burst(bus: Bus, run_id: str) -> None:
    got = await _fetch_during_a_burst(bus, run_id, linger_s=1.0)
    assert sorted(got) == sorted(f"p{i}" for i in range(8))


async def test_a_batch_counts_rows_so_validation_work_fills_it_in_one_pass(bus: Bus, run_id: str) -> None:
    """Room for 4 training prompts (n=2, 8 rows) takes 7 validation prompts (n=1; an eighth row would leave no
    room for the training prompt that may follow), and never more than 8 rows when training work follows them
    in the queue."""
    consumer = await bus.consumer(Stage.PROMPTS, "rollout")
    await asyncio.gather(*(bus.publish(Stage.PROMPTS, prompt(run_id, i, n=1)) for i in range(10)))
    await asyncio.gather(*(bus.publish(Stage.PROMPTS, prompt(run_id, i, n=2)) for i in range(10, 14)))
    batches = []
    for _ in range(3):
        got = await fetch_batch(consumer, rows=8, widest=2, timeout=5.0, linger_s=0.0)
        for d in got:
            await d.ack()
        batches.append([(d.message.prompt_id, d.message.n) for d in got])
    await consumer.close()
    assert batches[0] == [(f"p{i}", 1) for i in range(7)]
    assert batches[1] == [("p7", 1), ("p8", 1), ("p9", 1), ("p10", 2), ("p11", 2)]
    assert batches[2] == [("p12", 2), ("p13", 2)]
