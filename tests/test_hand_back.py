"""Work a dead replica held goes back on the queue as soon as the learner knows the process is gone, against a
real NATS server: the replica's last heartbeat names the ack subjects of what it holds, the learner's push
membership (after a failed push) finds nobody listening on its roll-call subject and NAKs them, and another
replica fetches the work well inside the stage's ack wait. Nothing a heartbeat names is sent to unless it is
an ack of the replicas' own prompt deliveries."""

from __future__ import annotations

import asyncio
import time

from e2e_utils import prompt_work

from rlbus.bus import Bus, Stage
from rlbus.bus.hand_back import ROLLOUT_DURABLE, ours_to_hand_back
from rlbus.bus.roll_call import answer_roll_calls, is_gone
from rlbus.config import RlbusConfig
from rlbus.learner.push_members import PushMembership
from rlbus.logs import get_logger
from rlbus.messages import HOLDING_MAX, Heartbeat, PromptWork
from rlbus.service import ServiceContext

ACK_WAIT_S = 30.0  # the stage's ack wait here: work that came back sooner was handed back


def _beat(bus: Bus, replica_id: str, incarnation: str, held: list) -> Heartbeat:
    """A rollout replica's heartbeat naming the deliveries it holds."""
    return Heartbeat(
        run_id=bus.names.run_id,
        service="rollout",
        instance_id=replica_id,
        time=time.time(),
        incarnation=incarnation,
        holding=[d.ack_subject for d in held],
    )


def test_only_acks_of_the_replicas_own_deliveries_are_handed_back() -> None:
    own = "$JS.ACK.rlbus_r_prompts.rollout.1.42.42.1733450000000000000.3"
    holding = [
        own,
        "$JS.ACK.rlbus_r_prompts.reward.1.42.42.1733450000000000000.3",  # another stage's consumer
        "$JS.ACK.rlbus_other_prompts.rollout.1.7.7.1733450000000000000.0",  # another stream
        "rlbus.r.prompts",  # a work subject: a NAK there would be a publish
        "$JS.ACK.rlbus_r_prompts.rollout.>",  # a wildcard
        "$JS.ACK.rlbus_r_prompts.rollout.1 2",
    ]
    assert ours_to_hand_back(holding, ["rlbus_r_prompts"], ROLLOUT_DURABLE) == [own]


async def test_a_gone_replicas_work_is_handed_back_after_a_failed_push(bus: Bus, bus_config) -> None:
    log = get_logger("test-hand-back")
    consumer = await bus.consumer(Stage.PROMPTS, ROLLOUT_DURABLE, expected=PromptWork, ack_wait_s=ACK_WAIT_S)
    for i in range(3):
        await bus.publish(Stage.PROMPTS, prompt_work(bus.names.run_id, i), msg_id=f"p{i}")
    state = await bus.state()
    async with Bus.connect(bus_config, name="replica-r0", ensure=False) as replica:
        await answer_roll_calls(replica.nc, replica.names, "r0", "inc-a", log)
        held_by_r0 = await replica.consumer(
            Stage.PROMPTS, ROLLOUT_DURABLE, expected=PromptWork, ack_wait_s=ACK_WAIT_S
        )
        held = await held_by_r0.fetch(batch=3, timeout=5)
        assert len(held) == 3
        await state.heartbeat(_beat(bus, "r0", "inc-a", held))
        assert not await is_gone(bus.nc, bus.names, "r0")  # it listens: alive
    # r0's process is gone (its connection closed): a push to it failed
    ctx = ServiceContext(bus_config, "learner", "learner", bus, state, asyncio.Event(), log)
    membership = PushMembership(ctx, join_window_s=0.5, backoff_base_s=30.0)
    t0 = time.monotonic()
    await membership.failed({"r0": "inc-a"}, ["r0"], "broken")
    again = []
    while len(again) < 3 and time.monotonic() - t0 < ACK_WAIT_S / 3:
        again += await consumer.fetch(batch=3, timeout=1.0)
    took = time.monotonic() - t0
    assert sorted(d.message.prompt_id for d in again) == ["p0", "p1", "p2"], f"after {took:.1f} s"
    assert all(d.num_delivered == 2 for d in again)
    assert membership.handed_back == 3
    for d in again:
        await d.ack()


async def test_a_live_replicas_work_is_not_handed_back(bus: Bus, bus_config) -> None:
    """A push that failed for a replica still listening (a slow or broken rendezvous): its work stays its own."""
    log = get_logger("test-hand-back")
    consumer = await bus.consumer(Stage.PROMPTS, ROLLOUT_DURABLE, expected=PromptWork, ack_wait_s=ACK_WAIT_S)
    await bus.publish(Stage.PROMPTS, prompt_work(bus.names.run_id, 0), msg_id="p0")
    state = await bus.state()
    async with Bus.connect(bus_config, name="replica-r1", ensure=False) as replica:
        await answer_roll_calls(replica.nc, replica.names, "r1", "inc-b", log)
        held = await consumer.fetch(batch=1, timeout=5)
        await state.heartbeat(_beat(bus, "r1", "inc-b", held))
        ctx = ServiceContext(bus_config, "learner", "learner", bus, state, asyncio.Event(), log)
        membership = PushMembership(ctx, join_window_s=0.5, backoff_base_s=30.0)
        await membership.failed({"r1": "inc-b"}, ["r1"], "broken")
        assert await consumer.fetch(batch=1, timeout=2.0) == []  # not redelivered
        assert membership.handed_back == 0
        await held[0].ack()


def test_a_beat_names_at_most_holding_max_deliveries() -> None:
    """More held work than a beat may name must not make the beat itself invalid (the replica would look dead)."""
    ctx = ServiceContext(RlbusConfig(), "rollout", "r0", None, None, asyncio.Event(), get_logger("test"))
    ctx.hold([f"$JS.ACK.s.rollout.1.{i}.{i}.0.0" for i in range(HOLDING_MAX + 10)])
    beat = ctx.heartbeat()
    assert len(beat.holding) == HOLDING_MAX and beat.holding[0] == "$JS.ACK.s.rollout.1.0.0.0.0"
