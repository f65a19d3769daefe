"""Faults against real NATS servers of the test's own: a server restart mid-run, hostile bytes on work subjects.

Every test here uses `private_nats` (own port, own storage): the shared server on 4222 is never touched.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import numpy as np
import pytest
from e2e_utils import Run, make_config

from rlbus import codec
from rlbus.bus import Bus, LocalNatsServer, Stage
from rlbus.bus.headers import CLAIM_HEADER, CLAIM_SIZE_HEADER
from rlbus.config import RlbusConfig
from rlbus.messages import (
    SCHEMA_VERSION,
    PromptWork,
    ReadyGroup,
    SamplingParams,
    ScoredGroup,
    TrajectoryGroup,
    decode,
    encode,
)
from rlbus.reward.service import FETCH_BATCH as REWARD_FETCH_BATCH

STEPS, BATCH = 30, 8  # long enough that the attack lands mid-run on a fast machine
RESTART_STEPS = 200  # a step takes ~0.1 s on an idle machine: both outages must land mid-run
RUN = [
    f"trainer.total_training_steps={STEPS}",
    f"data.train_batch_size={BATCH}",
    "rollout.n=4",
    "rollout.prompts_per_batch=4",
    "trainer.async_level=1",
    "trainer.val_before_train=false",
    "trainer.test_freq=0",
]


def _check_ledger(run: Run) -> dict:
    ledger = run.ledger()
    dispatched, trained, dropped = set(ledger["dispatched"]), set(ledger["trained"]), set(ledger["dropped"])
    steps = int(run.cfg.trainer.total_training_steps or STEPS)
    assert len(trained) == steps * BATCH, f"trained {len(trained)} prompts, want {steps * BATCH}"
    assert trained.isdisjoint(dropped)
    assert dispatched == trained | dropped, "every dispatched prompt is trained on or explicitly dropped"
    return ledger


def _logs(run: Run) -> str:
    return "\n".join(f"===== {p.name}\n{run.logs(p.name, 40)}" for p in run.procs)


@pytest.mark.timeout(240)
def test_nats_restart_and_crash_mid_run_lose_no_work(
    private_nats: LocalNatsServer, run_id: str, tmp_path: Path
) -> None:
    """A graceful restart at step 3 and a crash (SIGKILL) two steps later, each with 2 s of outage."""
    cfg = make_config(
        private_nats.url, run_id, tmp_path, [*RUN, f"trainer.total_training_steps={RESTART_STEPS}"]
    )
    with Run(cfg) as run:
        run.wait_for_step(3, 150)
        private_nats.stop()  # SIGTERM: JetStream flushes its file store; the port stays ours
        time.sleep(2.0)  # every service sees the outage, not just a blip
        private_nats.start()
        run.wait_for_step(int(run.metrics()[-1]["step"]) + 2, 120)
        assert run.learner.alive, "the run ended before the crash; make it longer"
        private_nats.kill()  # a crash: consumer state on disk may be behind what was delivered
        time.sleep(2.0)
        private_nats.start()
        rc = run.wait_learner(180)
        assert rc == 0, _logs(run)
        assert all(p.alive for p in run.procs if p.name != "learner"), _logs(run)
        _check_ledger(run)
        rows = [r for r in run.metrics() if "reward/mean" in r]
        assert [int(r["step"]) for r in rows] == list(range(1, RESTART_STEPS + 1))
        text = "\n".join(p.log_path.read_text(errors="replace") for p in run.procs)  # whole logs, not tails
        assert text.count("bus.reconnected") >= 6, _logs(run)  # each of the three services, twice
        assert "Traceback" not in text, _logs(run)


MiB = 1024 * 1024
FLOOD = 10_000


def _junk(run_id: str) -> list[tuple[bytes, dict[str, str] | None, str]]:
    """(payload, headers, expected reason fragment) of every hostile message but the flood."""
    work = PromptWork(
        run_id=run_id,
        prompt_id="intruder",
        index=0,
        step=0,
        min_policy_version=0,
        prompt_ids=[1, 2],
        n=1,
        sampling=SamplingParams(),
    )
    return [
        (b"\xc1 not msgpack at all", None, "not a msgpack frame"),
        (b"", None, "not a msgpack frame"),
        (b"\xc1" * (7 * MiB), None, "not a msgpack frame"),  # oversized: near the 8 MiB max_payload
        (b"\xc6\xff\xff\xff\xff" + b"x" * 16, None, "not a msgpack frame"),  # claims a 4 GiB binary
        (b"\x91" * 100_000, None, "not a msgpack frame"),  # nested 100k deep
        (codec.pack({"hello": "world"}), None, "not an rlbus envelope"),
        (
            codec.pack({"kind": "trajectory_group", "v": SCHEMA_VERSION + 1, "body": {}}),
            None,
            f"schema version {SCHEMA_VERSION + 1} is not {SCHEMA_VERSION}",
        ),
        (codec.pack({"kind": "nonsense", "v": SCHEMA_VERSION, "body": {}}), None, "unknown message kind"),
        (encode(work), None, "expected trajectory_group, got prompt_work"),
        (
            codec.pack({"kind": "trajectory_group", "v": SCHEMA_VERSION, "body": {"work": 5}}),
            None,
            "invalid trajectory_group",
        ),
        (
            codec.pack({"claim": "trajectories/nothing-here", "size": 100 * MiB}),
            {CLAIM_HEADER: "trajectories/nothing-here", CLAIM_SIZE_HEADER: str(100 * MiB)},
            "is missing",
        ),
    ]


async def _attack(cfg: RlbusConfig) -> list[tuple[bytes, str]]:
    """Publishes the hostile messages and the flood; returns each non-flood one's payload and expected reason."""
    from nats.errors import MaxPayloadError

    async with Bus.connect(cfg, name="attacker", ensure=False) as bus:
        expected = []
        for data, headers, reason in _junk(cfg.run.id):
            await bus.publish_raw(Stage.TRAJECTORIES, data, headers=headers)
            expected.append((data, reason))
        with pytest.raises(MaxPayloadError):  # above max_payload: refused before it reaches the bus
            await bus.publish_raw(Stage.TRAJECTORIES, b"\xc1" * (9 * MiB))
        for start in range(0, FLOOD, 500):
            await asyncio.gather(
                *(bus.publish_raw(Stage.TRAJECTORIES, b"junk-%d" % i) for i in range(start, start + 500))
            )
        # One of each on the other stages: the rollout and the learner dead-letter too.
        for stage in (Stage.PROMPTS, Stage.READY):
            await bus.publish_raw(stage, b"\xc1 junk")
            await bus.publish_raw(stage, codec.pack({"kind": "x", "v": SCHEMA_VERSION + 1, "body": {}}))
        return expected


async def _dead_letters(cfg: RlbusConfig, n_first: int) -> tuple[dict[Stage, int], list]:
    async with Bus.connect(cfg, name="inspector", ensure=False) as bus:
        counts = {
            stage: await bus.dead_letter_count(stage)
            for stage in (Stage.PROMPTS, Stage.TRAJECTORIES, Stage.READY)
        }
        return counts, await bus.dead_letters(Stage.TRAJECTORIES, limit=n_first)


@pytest.mark.timeout(300)
def test_hostile_messages_are_dead_lettered_and_the_run_completes(
    private_nats: LocalNatsServer, run_id: str, tmp_path: Path
) -> None:
    cfg = make_config(private_nats.url, run_id, tmp_path, RUN)
    with Run(cfg) as run:
        run.wait_for_step(2, 150)
        t0 = time.monotonic()
        expected = asyncio.run(_attack(cfg))
        published_s = time.monotonic() - t0
        want = {Stage.PROMPTS: 2, Stage.TRAJECTORIES: len(expected) + FLOOD, Stage.READY: 2}
        deadline = time.monotonic() + 150
        while True:
            # a batch's invalid messages are dead-lettered together: the flood's first batch may come between
            counts, first = asyncio.run(_dead_letters(cfg, len(expected) + REWARD_FETCH_BATCH))
            if counts == want or time.monotonic() > deadline:
                break
            assert all(p.alive for p in run.procs), _logs(run)
            time.sleep(2.0)
        assert counts == want, f"dead letters {counts}, want {want}\n{_logs(run)}"
        drained_s = time.monotonic() - t0
        # every service is still up (the learner may already have finished its run, cleanly)
        assert all(p.alive or (p.name == "learner" and p.proc.returncode == 0) for p in run.procs), _logs(run)
        for data, fragment in expected:  # each kept whole for inspection (the 7 MiB one too), with its reason
            reason, headers, _data = next(letter for letter in first if letter.data == data)
            assert fragment in reason, (fragment, reason)
            assert headers["Rlbus-Stage"] == "trajectories" and headers["Rlbus-Consumer"] == "reward"
        rc = run.wait_learner(180)
        assert rc == 0, _logs(run)
        assert all(p.alive for p in run.procs if p.name != "learner"), _logs(run)
        _check_ledger(run)
    print(f"published in {published_s:.1f}s, all dead-lettered after {drained_s:.1f}s")


async def test_acks_through_a_server_crash_never_raise_and_lose_nothing(
    private_nats: LocalNatsServer, run_id: str, tmp_path: Path
) -> None:
    """Items delivered just before a crash: the restarted server may have lost those deliveries (its
    consumer state on disk lags) and then ignores their acks. Acking returns (confirmed or not) and never
    raises or hangs; what the server forgot comes back by redelivery; in the end every item is consumed."""
    cfg = RlbusConfig(run={"id": run_id, "dir": tmp_path}, bus={"url": private_nats.url})
    async with Bus.connect(cfg, name="crash-acker") as bus:
        consumer = await bus.consumer(Stage.PROMPTS, "rollout", ack_wait_s=3)
        private_nats.restart()  # from the second start on, fresh delivery state is flushed lazily
        unconfirmed = 0
        for cycle in range(3):
            ids = {f"c{cycle}-p{i}" for i in range(6)}
            for pid in sorted(ids):
                await bus.publish(
                    Stage.PROMPTS,
                    PromptWork(
                        run_id=run_id,
                        prompt_id=pid,
                        index=0,
                        step=0,
                        min_policy_version=0,
                        prompt_ids=[1],
                        n=1,
                        sampling=SamplingParams(),
                    ),
                    msg_id=pid,
                )
            held: list = []
            while len(held) < 6:
                held += await consumer.fetch(6 - len(held), timeout=5)
            private_nats.kill()
            private_nats.start()
            t0 = time.monotonic()
            confirmed = [await d.ack() for d in held]
            assert time.monotonic() - t0 < 40, "unanswered acks are given up on quickly"
            unconfirmed += confirmed.count(False)
            seen = {d.message.prompt_id for d, ok in zip(held, confirmed, strict=True) if ok}
            deadline = time.monotonic() + 30
            while seen != ids and time.monotonic() < deadline:  # the forgotten ones come again
                for d in await consumer.fetch(6, timeout=2):
                    assert await d.ack()
                    seen.add(d.message.prompt_id)
            assert seen == ids
            assert await bus.stream_depth(Stage.PROMPTS) == 0
            if unconfirmed:
                break
        assert unconfirmed, "the crash never made the server forget a delivery: this test checked nothing"


def _hostile_work(run_id: str) -> list[tuple[PromptWork, str]]:
    """Schema-valid PromptWork no engine should take, each with the reason fragment its dead letter carries."""

    def work(pid: str, ids: list[int], n: int = 1, max_tokens: int = 8) -> PromptWork:
        return PromptWork(
            run_id=run_id,
            prompt_id=pid,
            index=0,
            step=0,
            min_policy_version=0,
            prompt_ids=ids,
            n=n,
            sampling=SamplingParams(max_tokens=max_tokens),
        )

    return [
        (work("hostile-token", [1, 10_000_000, 2]), "token id 10000000 is outside the vocabulary"),
        (work("hostile-negative", [1, -5]), "token id -5 is outside the vocabulary"),
        (work("hostile-length", [1] * 100_000), "prompt of 100000 tokens is over the run's limit"),
        (work("hostile-n", [1, 2], n=1_000_000), "n=1000000 samples is outside"),
        (work("hostile-max-tokens", [1, 2], max_tokens=10_000_000), "max_tokens=10000000 is outside"),
    ]


@pytest.mark.timeout(240)
def test_hostile_prompt_work_is_dead_lettered_alone_and_no_replica_exits(
    private_nats: LocalNatsServer, run_id: str, tmp_path: Path
) -> None:
    """Well-formed work that would crash or stall an engine: each item is parked with its reason, the
    replica keeps generating its batch-mates, and the run trains every step on honest prompts."""
    cfg = make_config(private_nats.url, run_id, tmp_path, RUN)
    hostile = _hostile_work(cfg.run.id)

    async def inject() -> None:
        async with Bus.connect(cfg, name="attacker", ensure=False) as bus:
            for work, _ in hostile:
                await bus.publish(Stage.PROMPTS, work, msg_id=work.prompt_id)

    async def parked() -> list:
        async with Bus.connect(cfg, name="inspector", ensure=False) as bus:
            return await bus.dead_letters(Stage.PROMPTS, limit=50)

    with Run(cfg) as run:
        run.wait_for_step(2, 150)
        asyncio.run(inject())
        rc = run.wait_learner(180)
        assert rc == 0, _logs(run)
        assert all(p.alive for p in run.procs if p.name != "learner"), _logs(run)
        letters = {dl.headers.get("Rlbus-Original-Msg-Id"): dl.reason for dl in asyncio.run(parked())}
        for work, fragment in hostile:
            assert fragment in letters.get(work.prompt_id, ""), (work.prompt_id, letters)
        assert set(letters) == {w.prompt_id for w, _ in hostile}, "only the hostile items were parked"
        ledger = _check_ledger(run)
        assert not any(pid.startswith("hostile") for pid in ledger["dispatched"])
        rollout_log = "\n".join(
            p.log_path.read_text(errors="replace") for p in run.procs if p.name.startswith("rollout")
        )
        assert rollout_log.count("work item dead-lettered") == len(hostile), rollout_log[-3000:]


# ---------------------------------------------------------------- hostile ready groups for prompts in flight

HOSTILE_READY = [  # (what is done to an honest-looking group, the fragment of its dead letter's reason)
    ("fewer rewards than samples", "rewards and"),
    ("log-probs shorter than the response", "log-probs for"),
    ("one log-prob for the whole response", "log-probs for"),
    ("out-of-vocabulary response token", "outside the vocabulary"),
    ("NaN log-prob", "non-finite log-prob"),
    ("+inf reward", "reward is not finite"),
]


def _hostile_ready(traj: TrajectoryGroup, what: str) -> ReadyGroup:
    """A schema-valid ReadyGroup for `traj`'s prompt (really in flight), broken the way `what` says."""
    n = len(traj.samples)
    samples = [s.model_copy() for s in traj.samples]
    rewards = [1.0] * n
    first = samples[0]
    long_enough = max(range(n), key=lambda i: len(samples[i].response_ids))
    if what == "fewer rewards than samples":
        rewards = rewards[:1]
    elif what == "log-probs shorter than the response":
        s = samples[long_enough]
        samples[long_enough] = s.model_copy(
            update={"response_ids": [*s.response_ids, 1, 1], "logprobs": np.asarray(s.logprobs)}
        )
    elif what == "one log-prob for the whole response":
        s = samples[long_enough]
        samples[long_enough] = s.model_copy(
            update={"response_ids": [*s.response_ids, 1, 1], "logprobs": np.asarray([-0.1])}
        )
    elif what == "out-of-vocabulary response token":
        samples[0] = first.model_copy(
            update={"response_ids": [10_000_000], "logprobs": np.asarray([-0.1], np.float32)}
        )
    elif what == "NaN log-prob":
        samples[0] = first.model_copy(
            update={"response_ids": [1], "logprobs": np.asarray([np.nan], np.float32)}
        )
    elif what == "+inf reward":
        rewards[0] = float("inf")
    scored = ScoredGroup(
        trajectories=traj.model_copy(update={"samples": samples}), rewards=rewards, correct=[True] * n
    )
    return decode(encode(ReadyGroup(scored=scored)), ReadyGroup)  # schema-valid on the wire


@pytest.mark.timeout(300)
def test_hostile_ready_groups_for_prompts_in_flight_are_dead_lettered_alone(
    private_nats: LocalNatsServer, run_id: str, tmp_path: Path
) -> None:
    """Each shape that crashed the learner (or trained on a broadcast, or skipped an honest step) arrives on the
    ready stream before the honest group of a prompt really in flight: it is dead-lettered alone with its
    reason, the prompt goes out again, the learner never restarts, and every step trains a full batch."""
    cfg = make_config(private_nats.url, run_id, tmp_path, RUN)
    run = Run(cfg)
    reward = run.proc("reward")
    seen: dict[str, TrajectoryGroup] = {}

    async def attack() -> dict[str, str]:
        """Watch the trajectories subject (a plain subscription consumes nothing) while reward is down; for
        the first prompts in flight, publish one hostile ready group each; returns prompt id -> shape."""
        async with Bus.connect(cfg, name="attacker", ensure=False) as bus:
            got = asyncio.Event()

            async def on_traj(msg) -> None:
                traj = decode(msg.data, TrajectoryGroup)
                if traj.work.split == "train" and len(seen) < len(HOSTILE_READY):
                    seen.setdefault(traj.work.prompt_id, traj)
                    if len(seen) == len(HOSTILE_READY):
                        got.set()

            sub = await bus.nc.subscribe(bus.names.subject(Stage.TRAJECTORIES), cb=on_traj)
            await asyncio.wait_for(got.wait(), 150)
            await sub.unsubscribe()
            sent = {}
            for (pid, traj), (what, _) in zip(seen.items(), HOSTILE_READY, strict=True):
                await bus.publish(Stage.READY, _hostile_ready(traj, what), msg_id=f"hostile-{pid}")
                sent[pid] = what
            return sent

    async def parked() -> dict[str, str]:
        async with Bus.connect(cfg, name="inspector", ensure=False) as bus:
            return {
                dl.headers.get("Rlbus-Original-Msg-Id", ""): dl.reason
                for dl in await bus.dead_letters(Stage.READY, limit=50)
            }

    try:
        for p in run.procs:
            if p is not reward:
                p.start()
        sent = asyncio.run(attack())
        reward.start()  # the honest groups follow the hostile ones
        rc = run.wait_learner(240)
        assert rc == 0, _logs(run)
        letters = asyncio.run(parked())
        fragments = dict(HOSTILE_READY)
        for pid, what in sent.items():
            assert fragments[what] in letters.get(f"hostile-{pid}", ""), (what, letters)
        assert set(letters) == {f"hostile-{pid}" for pid in sent}, "only the hostile groups were parked"
        ledger = _check_ledger(run)
        for pid in sent:
            assert ledger["dropped"][pid] == "refused", (pid, ledger["dropped"].get(pid))
        rows = run.metrics()
        assert [r["step"] for r in rows if "actor/grad_norm" in r] == list(range(1, STEPS + 1))
        assert all(np.isfinite(r["actor/grad_norm"]) for r in rows if "actor/grad_norm" in r)
        learner_log = run.learner.log_path.read_text(errors="replace")
        assert learner_log.count("ready group refused") == len(sent), learner_log[-3000:]
        assert "Traceback" not in learner_log, learner_log[-3000:]
    finally:
        run.__exit__(None)
