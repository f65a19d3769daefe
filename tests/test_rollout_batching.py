"""A replica's generation batch is filled from a burst of prompts that reach the server one by one (real NATS)."""

from __future__ import annotations

import asyncio
import time

import pytest

from rlbus.bus import Bus, Stage
from rlbus.rollout.batching import LINGER_MAX_S, fetch_batch, linger_after
from tests.test_bus import prompt


def test_linger_is_a_bounded_share_of_the_last_pass_and_none_for_cheap_passes() -> None:
    assert linger_after(0.0) == 0.0  # nothing measured yet
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
    fetching = asyncio.create_task(fetch_batch(consumer, batch=8, timeout=5.0, linger_s=linger_s))
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
