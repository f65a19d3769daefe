"""Stages sharded by subject (bus.partitions): a prompt id hashes to one partition at every stage and on every
retry, each partition is a stream of its own, one consumer fetches from all of them, a role's permissions
cover every partition of what it owns; and a whole `rlbus up` run trains on 4 partitions."""

from __future__ import annotations

import json
import subprocess
import time
from collections import Counter
from pathlib import Path

import pytest
from e2e_utils import prompt_work, up_command

from rlbus.bus import Bus, LocalNatsServer, Stage
from rlbus.bus.roles import authorization_block, make_users
from rlbus.bus.subjects import RunNames, partition_of
from rlbus.config import RlbusConfig

PARTITIONS = 4


def test_a_key_always_lands_on_the_same_partition_and_keys_spread() -> None:
    keys = [f"run-p{i}" for i in range(2000)]
    first = [partition_of(k, PARTITIONS) for k in keys]
    assert first == [partition_of(k, PARTITIONS) for k in keys]
    counts = Counter(first)
    assert sorted(counts) == list(range(PARTITIONS))
    assert min(counts.values()) > 2000 / PARTITIONS * 0.8, counts
    assert {partition_of(k, 1) for k in keys} == {0}


def test_partition_zero_keeps_the_unpartitioned_names() -> None:
    one, four = RunNames("r"), RunNames("r", PARTITIONS)
    assert four.subject(Stage.READY, 0) == one.subject(Stage.READY)
    assert four.stream(Stage.READY, 0) == one.stream(Stage.READY)
    assert len(set(four.streams(Stage.READY))) == len(set(four.subjects(Stage.READY))) == PARTITIONS
    assert len(four.all_streams()) == len(one.all_streams()) + len(Stage) * (PARTITIONS - 1)


def _partitioned(cfg: RlbusConfig) -> RlbusConfig:
    out = cfg.model_copy(deep=True)
    out.bus.partitions = PARTITIONS
    return out


async def test_work_spreads_over_partition_streams_and_one_consumer_takes_it_all(bus_config) -> None:
    cfg = _partitioned(bus_config)
    async with Bus.connect(cfg, name="partitions") as bus:
        try:
            for i in range(40):
                result = await bus.publish(Stage.PROMPTS, prompt_work(bus.run_id, i), msg_id=f"p{i}")
                assert result.stream == bus.names.stream(Stage.PROMPTS, bus.names.partition_of(f"p{i}"))
            again = await bus.publish(Stage.PROMPTS, prompt_work(bus.run_id, 7), msg_id="p7")
            assert again.duplicate, "a retry went to another partition, where deduplication cannot see it"
            depths = [
                int((await bus.js.stream_info(s)).state.messages) for s in bus.names.streams(Stage.PROMPTS)
            ]
            assert sum(depths) == await bus.stream_depth(Stage.PROMPTS) == 40
            assert sum(1 for d in depths if d) >= 3, depths
            consumer = await bus.consumer(Stage.PROMPTS, "rollout", ack_wait_s=30)
            seen: list[str] = []
            while len(seen) < 40:
                got = await consumer.fetch(batch=8, timeout=5.0)
                assert got, f"fetched {len(seen)} of 40, then nothing"
                assert len(got) <= 8
                for d in got:
                    seen.append(d.message.prompt_id)
                    assert await d.ack()
            assert sorted(seen) == sorted(f"p{i}" for i in range(40))
            assert await consumer.fetch(batch=8, timeout=0.3) == []
            await consumer.close()
            assert await bus.stream_depth(Stage.PROMPTS) == 0
        finally:
            await bus.delete_run()


async def _refused(bus: Bus, subject: str) -> bool:
    try:
        await bus.js.publish(subject, b"x", timeout=0.7)
    except Exception:  # noqa: BLE001 - the server dropped it: no ack
        return True
    return False


@pytest.mark.timeout(120)
async def test_a_roles_rights_cover_every_partition_of_what_it_owns(run_id: str, tmp_path: Path) -> None:
    names = RunNames(run_id, PARTITIONS)
    users = {
        u.instance or u.role: u for u in make_users(names, {"learner": "learner", "rollout-0": "rollout"})
    }
    extra = authorization_block(list(users.values()), names, needs_ref=False)
    with LocalNatsServer(tmp_path / "nats", extra_config=extra) as server:
        cfg = RlbusConfig(
            run={"id": run_id, "dir": tmp_path}, bus={"url": server.url, "partitions": PARTITIONS}
        )

        def as_(who: str) -> RlbusConfig:
            out = cfg.model_copy(deep=True)
            out.bus.user, out.bus.password = users[who].user, users[who].password
            return out

        async with Bus.connect(as_("learner"), name="learner") as learner:
            for i in range(12):
                await learner.publish(Stage.PROMPTS, prompt_work(run_id, i), msg_id=f"p{i}")
        async with Bus.connect(as_("rollout-0"), name="rollout-0") as rollout:
            consumer = await rollout.consumer(Stage.PROMPTS, "rollout", ack_wait_s=30)
            taken = 0
            while taken < 12:
                got = await consumer.fetch(batch=12, timeout=5.0)
                assert got, f"the rollout fetched {taken} of 12 prompts, then was refused or starved"
                for d in got:
                    assert await d.ack()
                taken += len(got)
            await consumer.close()
            for k in range(PARTITIONS):
                assert not await _refused(rollout, names.subject(Stage.TRAJECTORIES, k)), k
                assert await _refused(rollout, names.subject(Stage.READY, k)), k
        async with Bus.connect(as_("learner"), name="learner", ensure=False) as learner:
            for k in range(1, PARTITIONS):
                assert await _refused(learner, names.subject(Stage.READY, k)), k
            await learner.delete_run()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_rlbus_up_trains_on_four_partitions_under_roles(run_id: str, tmp_path: Path) -> None:
    """`rlbus up` on its own server (one user per process) with bus.partitions=4 and two replicas: every step
    trains, every prompt is settled once, and no process met a permission it lacked."""
    steps, batch = 6, 8
    run_dir = tmp_path / "runs" / run_id
    done = subprocess.run(
        up_command(
            tmp_path,
            None,
            run_id,
            f"trainer.total_training_steps={steps}",
            f"data.train_batch_size={batch}",
            "trainer.val_before_train=false",
            "trainer.test_freq=0",
            "rollout.replicas=2",
            f"bus.partitions={PARTITIONS}",
        ),
        capture_output=True,
        text=True,
        timeout=280,
        cwd=tmp_path,
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    ledger = json.loads((run_dir / "ledger.json").read_text())
    assert len(ledger["trained"]) == steps * batch
    assert set(ledger["dispatched"]) == set(ledger["trained"]) | set(ledger["dropped"])
    for log in ("learner", "reward", "rollout-0", "rollout-1"):
        text = (run_dir / "logs" / f"{log}.log").read_text(errors="replace").lower()
        assert "permissions violation" not in text, log
    server_log = (run_dir / "nats" / "nats-server.log").read_text(errors="replace")
    assert "Permissions Violation" not in server_log, server_log[-3000:]


async def test_deliveries_waiting_in_the_fan_in_are_kept_alive_past_their_ack_wait(bus_config) -> None:
    """A poll that lands after `fetch` returned keeps its deliveries for the next fetch. While replica A is
    busy for longer than the ack wait, replica B keeps fetching: it must not be handed A's waiting work."""
    cfg = _partitioned(bus_config)
    async with Bus.connect(cfg, name="replica-a") as bus:
        try:
            ids = [f"p{i}" for i in range(40)]
            for i, pid in enumerate(ids):
                await bus.publish(Stage.PROMPTS, prompt_work(bus.run_id, i), msg_id=pid)
            a = await bus.consumer(Stage.PROMPTS, "rollout", ack_wait_s=1.0)
            [first] = await a.fetch(batch=1, timeout=5.0)
            seen = [first.message.prompt_id]
            await first.ack()
            async with Bus.connect(cfg, name="replica-b", ensure=False) as other:
                b = await other.consumer(Stage.PROMPTS, "rollout", ack_wait_s=1.0)
                busy_until = time.monotonic() + 2.5  # A generates for 2.5 s, past the 1 s ack wait
                while time.monotonic() < busy_until:
                    for d in await b.fetch(batch=16, timeout=0.5):
                        seen.append(d.message.prompt_id)
                        await d.ack()
                await b.close()
            held = await a.fetch(batch=16, timeout=0.05)
            assert held, "nothing waited in A's fan-in: the case under test did not happen"
            for d in held:
                seen.append(d.message.prompt_id)
                await d.ack()
            while got := await a.fetch(batch=16, timeout=1.0):  # what B handed back when it closed
                for d in got:
                    seen.append(d.message.prompt_id)
                    await d.ack()
            assert sorted(seen) == sorted(ids), "a prompt went to both replicas, or was lost"
            await a.close()
        finally:
            await bus.delete_run()
