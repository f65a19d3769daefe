"""A publish JetStream drops as a duplicate is judged (rlbus.bus.duplicates), against a real server: the same
bytes again is a harmless retry; another message under a known msg id is counted and logged as a conflict,
not dropped in silence; one whose kept message was already consumed cannot be compared and says so."""

from __future__ import annotations

import pytest
import structlog
from e2e_utils import prompt_work

from rlbus.bus import Bus, Stage
from rlbus.bus.duplicates import DuplicateVerdict


@pytest.mark.timeout(60)
async def test_a_different_message_under_a_known_msg_id_is_counted_and_logged(bus: Bus, run_id: str) -> None:
    honest, shadow = prompt_work(run_id, 1), prompt_work(run_id, 2)
    first = await bus.publish(Stage.PROMPTS, honest, msg_id="p1:work")
    assert not first.duplicate
    again = await bus.publish(Stage.PROMPTS, honest, msg_id="p1:work")  # a retry through a reconnect
    assert again.duplicate and again.seq == first.seq
    assert bus.duplicates[DuplicateVerdict.SAME] == 1 and bus.duplicates[DuplicateVerdict.DIFFERENT] == 0

    with structlog.testing.capture_logs() as logs:
        dropped = await bus.publish(Stage.PROMPTS, shadow, msg_id="p1:work")
    assert dropped.duplicate
    assert bus.duplicates[DuplicateVerdict.DIFFERENT] == 1
    [conflict] = [e for e in logs if e["event"].startswith("bus.duplicate_conflict")]
    assert conflict["msg_id"] == "p1:work" and conflict["kept_seq"] == first.seq

    consumer = await bus.consumer(Stage.PROMPTS, "rollout", ack_wait_s=5)
    [delivery] = await consumer.fetch(1, timeout=5)
    assert delivery.message.prompt_id == "p1"  # the first one was kept
    assert await delivery.ack()
    await bus.publish(Stage.PROMPTS, shadow, msg_id="p1:work")  # the kept one is gone from the work queue
    assert bus.duplicates[DuplicateVerdict.CONSUMED] == 1
