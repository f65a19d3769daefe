"""Seeded fault injection against `rlbus up`, as an operator would see it (make test-chaos).

One undisturbed run, then the same run while a seeded schedule SIGKILLs rollout replicas, the reward
service and the learner (after a checkpoint), restarts NATS on its store and publishes junk on the work
subjects. `rlbus up` restarts what dies. Asserted from the outside: every step trained once, the ledger
adds up, final held-out accuracy within noise of the undisturbed run, no stretch without a new metrics
row longer than 2x the replica timeout after any fault (plus the undisturbed start-up time after the
learner kill, for the checkpoint restore), and the whole run within 2x the undisturbed wall time.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from e2e_utils import FAST, running_services, up_command, wait_until

from rlbus.bus import Bus, LocalNatsServer, Stage
from rlbus.config import RlbusConfig
from rlbus.launcher import ServiceProcess
from rlbus.metrics_log import read_metrics

STEPS = 150
NATS_OUTAGE_S = 3.0
JUNK_FLOOD = 2000
BATCH = 16  # data.train_batch_size of the demo
SEED = 20261203
REPLICA_TIMEOUT_S = 8.0  # trainer.replica_timeout_s in FAST
OVERRIDES = [
    *FAST,
    f"trainer.total_training_steps={STEPS}",
    "trainer.save_freq=10",
    f"trainer.test_freq={STEPS}",
    "trainer.val_before_train=false",
    "rollout.replicas=2",
    "run.restart_backoff_s=0.5",
    f"trainer.seed={SEED}",
]


@dataclass
class Observed:
    """What the run showed from outside: when each new metrics row appeared, what was done to it."""

    start: float
    progress: list[float] = field(default_factory=list)  # times a new metrics row was first seen
    events: list[tuple[float, int, str]] = field(default_factory=list)  # (time, step, what)
    wall_s: float = 0.0
    startup_s: float = 0.0  # launch to the first trained step
    returncode: int | None = None
    stderr: str = ""

    def gap_after(self, t: float) -> float:
        """Seconds from `t` to the next new metrics row."""
        return next((p - t for p in self.progress if p > t), 0.0)

    def longest_stall(self) -> float:
        return max((b - a for a, b in zip(self.progress, self.progress[1:], strict=False)), default=0.0)


def _schedule(rng: random.Random) -> list[tuple[int, str]]:
    """Seeded fault plan: (step to act at, what). Replica, reward and NATS faults early, the learner once
    after the step-20 checkpoint, junk in between; spaced so each fault's cost shows on its own."""
    steps = sorted(rng.sample(range(6, 126, 6), 8))
    what = ["rollout-0", "rollout-1", "reward", "rollout", "nats", "junk", "rollout", "learner"]
    rng.shuffle(what)
    plan = list(zip(steps, what, strict=True))
    learner_at = next(i for i, (_, w) in enumerate(plan) if w == "learner")
    plan[learner_at] = (max(plan[learner_at][0], 24), "learner")
    return sorted(plan)


async def _publish_junk(cfg: RlbusConfig, n: int) -> None:
    async with Bus.connect(cfg, name="chaos-junk", ensure=False) as bus:
        for i in range(n):
            await bus.publish_raw(Stage.PROMPTS if i % 2 else Stage.TRAJECTORIES, b"\xc1 junk %d" % i)


def _run(
    tmp_path: Path,
    server: LocalNatsServer,
    run_id: str,
    plan: list[tuple[int, str]],
    rng: random.Random,
    overrides: list[str] = OVERRIDES,
) -> Observed:
    run_dir = tmp_path / "runs" / run_id
    obs = Observed(start=time.monotonic())
    extra: list[ServiceProcess] = []  # services the fault plan starts beside rlbus up's (a swapped-in reward)
    up = subprocess.Popen(
        up_command(tmp_path, server.url, run_id, *overrides),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
    )
    cfg = RlbusConfig(run={"id": run_id, "dir": tmp_path / "runs"}, bus={"url": server.url})
    last_row: tuple | None = None
    pending = list(plan)
    try:
        while up.poll() is None:
            if time.monotonic() - obs.start > 600:
                raise AssertionError("the run did not finish in 600 s")
            rows = [r for r in read_metrics(run_dir) if "reward/mean" in r]
            row = (rows[-1]["step"], rows[-1]["time"]) if rows else None
            now = time.monotonic()
            if row is not None and row != last_row:
                obs.progress.append(now)
                obs.startup_s = obs.startup_s or now - obs.start
                last_row = row
            step = int(row[0]) if row else 0
            if pending and step >= pending[0][0]:
                _, what = pending.pop(0)
                obs.events.append((now, step, _inject(what, run_dir, server, cfg, rng, extra)))
            time.sleep(0.1)
        obs.returncode = up.returncode
        obs.stderr = up.stderr.read() if up.stderr else ""
    finally:
        for p in extra:
            p.stop(timeout=10)
        if up.poll() is None:
            up.send_signal(signal.SIGINT)
            up.communicate(timeout=60)
    obs.wall_s = time.monotonic() - obs.start
    return obs


def _inject(
    what: str,
    run_dir: Path,
    server: LocalNatsServer,
    cfg: RlbusConfig,
    rng: random.Random,
    extra: list[ServiceProcess],
) -> str:
    if what == "nats":
        server.restart()
        return "NATS restarted on its store"
    if what == "nats-outage":
        server.kill()
        time.sleep(NATS_OUTAGE_S)  # the outage itself: how long the bus is gone
        server.start()
        return f"SIGKILL NATS, back after {NATS_OUTAGE_S:.0f} s"
    if what == "junk":
        asyncio.run(_publish_junk(cfg, 200))
        return "200 junk messages on prompts and trajectories"
    if what == "junk-flood":
        asyncio.run(_publish_junk(cfg, JUNK_FLOOD))
        return f"{JUNK_FLOOD} junk messages on prompts and trajectories"
    if what == "reward-swap":
        extra.append(_flaky_reward(run_dir).start())
        return "a reward service with a function that raises on 10% of inputs joins"
    if what == "reward-unswap":
        for p in extra:
            p.stop(timeout=10)
        return "the flaky reward service stops"
    running = running_services(run_dir)
    if what == "rollout":
        what = rng.choice(sorted(n for n in running if n.startswith("rollout")))
    pid = running.get(what)
    if pid is None:  # restarting right now: wait for its successor, then kill that
        wait_until(lambda: what in running_services(run_dir), 30, f"{what} to be back")
        pid = running_services(run_dir)[what]
    os.kill(pid, signal.SIGKILL)
    return f"SIGKILL {what}"


def _finished(obs: Observed, run_dir: Path, name: str) -> tuple[list[dict], dict]:
    """A finished run's metrics rows and ledger, once checked: it ended well, every step trained once, every
    dispatched prompt trained or dropped with a reason."""
    assert obs.returncode == 0, obs.stderr[-3000:]
    rows = read_metrics(run_dir)
    steps = [int(r["step"]) for r in rows if "reward/mean" in r]
    assert steps == list(range(1, STEPS + 1)), f"{name}: steps {steps}"
    ledger = json.loads((run_dir / "ledger.json").read_text())
    trained, dropped = set(ledger["trained"]), set(ledger["dropped"])
    assert len(trained) == STEPS * BATCH and not trained & dropped, name
    assert set(ledger["dispatched"]) == trained | dropped, f"{name}: a dispatched prompt is unaccounted for"
    return rows, ledger


# "Within noise", measured: the held-out accuracy is one greedy pass over 128 prompts after a seeded but
# timing-dependent RL run, and undisturbed runs of one seed ended at 0.625-0.781 (2026-12-05), so two such
# values differ by up to ~0.2 with nothing wrong. The train accuracy of the last 30 steps (3,840 samples) is
# the tight measure of what the faults did to learning; the held-out one guards against a collapse.
VAL_NOISE = 0.25
TRAIN_NOISE = 0.05


def _late_train_accuracy(rows: list[dict]) -> float:
    late = [r["reward/accuracy"] for r in rows if "reward/accuracy" in r][-30:]
    return sum(late) / len(late)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_seeded_faults_cost_seconds_and_lose_nothing(tmp_path: Path, summary_line) -> None:
    results = {}
    for name, plan in (("calm", []), ("chaos", _schedule(random.Random(SEED)))):
        with LocalNatsServer(tmp_path / name / "nats", max_payload_bytes=8 * 1024 * 1024) as server:
            run_id = f"chaos-{name}"
            obs = _run(tmp_path / name, server, run_id, plan, random.Random(SEED))
        rows, ledger = _finished(obs, tmp_path / name / "runs" / run_id, name)
        val = [r["val/accuracy"] for r in rows if "val/accuracy" in r]
        results[name] = (obs, val[-1], _late_train_accuracy(rows), ledger)

    calm, calm_acc, calm_train, _ = results["calm"]
    chaos, chaos_acc, chaos_train, ledger = results["chaos"]
    longest = chaos.longest_stall()
    stall_budget = 2 * REPLICA_TIMEOUT_S
    report = "\n".join(
        [
            f"undisturbed: {calm.wall_s:.1f} s, start-up {calm.startup_s:.1f} s, longest stall "
            f"{calm.longest_stall():.1f} s, final val accuracy {calm_acc:.3f}, train accuracy of the last 30 "
            f"steps {calm_train:.3f}",
            f"faults:      {chaos.wall_s:.1f} s ({chaos.wall_s / calm.wall_s:.2f}x), longest stall "
            f"{longest:.1f} s, final val accuracy {chaos_acc:.3f}, train accuracy of the last 30 steps "
            f"{chaos_train:.3f}",
            *(
                f"  at step {s:3d}: {what}, next step {chaos.gap_after(t):.1f} s later"
                for t, s, what in chaos.events
            ),
            f"  ledger: {len(ledger['trained'])} trained, dropped {dict(_count(ledger['dropped']))}",
        ]
    )
    print(report)
    for line in ["fault-injection run (tests/test_chaos.py):", *report.splitlines()]:
        summary_line(line)
    for t, step, what in chaos.events:  # each fault's own cost: the stall that follows it
        gap = chaos.gap_after(t)
        budget = stall_budget + (calm.startup_s if what == "SIGKILL learner" else 0.0)
        assert gap <= budget, (
            f"{what} at step {step}: {gap:.1f} s without a new step (budget {budget:.1f})\n{report}"
        )
    # Target 1.5x (issue 14), read from the report above in the CI log. The faults' cost is mostly process
    # restarts and requests lost with a NATS connection: 1.32x-1.51x in five fresh-clone CI runs on the
    # 2-core kind (2026-12-03/04), then 1.25x (2026-12-04) once services fork from a preloaded process
    # (rlbus.preforked) and requests end with their connection (rlbus.bus.disconnects). The assertion is a
    # regression guard with room for a slow machine; ratios are claimed from the report, not asserted tight.
    assert chaos.wall_s <= 2.0 * calm.wall_s, report
    assert abs(chaos_train - calm_train) <= TRAIN_NOISE, report
    assert abs(chaos_acc - calm_acc) <= VAL_NOISE, report


def _count(values: dict) -> dict:
    out: dict = {}
    for v in values.values():
        out[v] = out.get(v, 0) + 1
    return out


# ------------------------------------------------------------------------------ the heavy fault load (issue 27)

TESTS = Path(__file__).resolve().parent
# The operator's defaults (rlbus up's restart backoff among them). The final held-out accuracy (128 prompts,
# greedy) varies by about 0.05 between undisturbed runs alone: the train accuracy of the last 30 steps (7,680
# samples) is the tighter check on the learning itself.
HEAVY_OVERRIDES = [o for o in OVERRIDES if not o.startswith("run.restart_backoff_s")]
HEAVY_PLAN = [  # (step to act at, what): 10 SIGKILLs (4 of the learner), a NATS outage, a junk flood, a swap
    (8, "rollout-0"),
    (14, "learner"),
    (22, "reward-swap"),
    (28, "junk-flood"),
    (34, "rollout-1"),
    (44, "learner"),
    (52, "reward"),
    (60, "nats-outage"),
    (68, "rollout"),
    (78, "learner"),
    (88, "rollout"),
    (98, "reward"),
    (104, "reward-unswap"),
    (112, "learner"),
]


def _flaky_reward(run_dir: Path) -> ServiceProcess:
    """A second reward service on the same work, scoring with a function that raises on ~10% of inputs."""
    proc = ServiceProcess(
        "reward-flaky",
        "reward",
        [
            "--config",
            str(run_dir / "config.yaml"),
            "--instance-id",
            "reward-flaky",
            "reward.type=function",
            "reward.function=reward_fns:flaky_addition",
        ],
        run_dir / "logs" / "reward-flaky.log",
    )
    proc.env["PYTHONPATH"] = os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])
    proc.env.setdefault("OMP_NUM_THREADS", "1")
    return proc


def _fault_costs(calm_times: dict[int, float], heavy_times: dict[int, float], events: list) -> list[float]:
    """Each fault's own cost: the seconds the fault run took from its step to the next fault's step (or the
    last step) beyond what the undisturbed run took over the same steps, both on the learner's clock."""
    at = [step for _, step, _ in events]
    ends = [*at[1:], max(heavy_times)]
    return [
        (heavy_times[b] - heavy_times[a]) - (calm_times[b] - calm_times[a])
        for a, b in zip(at, ends, strict=True)
    ]


@pytest.mark.faults
@pytest.mark.timeout(1500)
def test_a_heavy_fault_load_costs_seconds_and_loses_nothing(tmp_path: Path, summary_line) -> None:
    """The load of issue 27, against undisturbed runs measured in the same job: 10 SIGKILLs (4 of them the
    learner), NATS SIGKILLed for 3 s, 2,000 junk messages, a reward that raises on 10% of inputs swapped in.
    The undisturbed run goes before and after the fault run, and the fault run is held to their mean wall
    time, so a machine that slows down (or speeds up) during the job does not move the ratio."""
    kills = [w for _, w in HEAVY_PLAN if w in ("learner", "reward") or w.startswith("rollout")]
    assert len(kills) >= 10 and kills.count("learner") == 4
    results = {}
    train_acc: dict[str, float] = {}
    step_times: dict[str, dict[int, float]] = {}
    for name, plan in (("calm", []), ("faults", HEAVY_PLAN), ("calm-after", [])):
        with LocalNatsServer(tmp_path / name / "nats", max_payload_bytes=8 * 1024 * 1024) as server:
            run_id = f"heavy-{name}"
            obs = _run(tmp_path / name, server, run_id, plan, random.Random(SEED), HEAVY_OVERRIDES)
        rows, ledger = _finished(obs, tmp_path / name / "runs" / run_id, name)
        train_acc[name] = _late_train_accuracy(rows)
        lost = {p: r for p, r in ledger["dropped"].items() if r == "run_finished_in_flight"}
        trained_idx = [ledger["dispatched"][p] for p in ledger["trained"]]
        val = [r["val/accuracy"] for r in rows if "val/accuracy" in r]
        # the stalls as the learner logged its steps (the observer's own clock pauses while it injects)
        step_times[name] = {int(r["step"]): float(r["time"]) for r in rows if "reward/mean" in r}
        times = sorted(step_times[name].values())
        obs.progress = [obs.start + t - times[0] + obs.startup_s for t in times]
        results[name] = (obs, val[-1], ledger, lost, len(trained_idx) - len(set(trained_idx)))

    calm, calm_acc, _, _, _ = results["calm"]
    after, after_acc, _, _, _ = results["calm-after"]
    heavy, heavy_acc, ledger, lost, twice = results["faults"]
    undisturbed_s = (calm.wall_s + after.wall_s) / 2
    costs = _fault_costs(step_times["calm"], step_times["faults"], heavy.events)
    stall_budget = 2 * REPLICA_TIMEOUT_S
    report = "\n".join(
        [
            f"undisturbed: {calm.wall_s:.1f} s before, {after.wall_s:.1f} s after (mean {undisturbed_s:.1f} s), "
            f"longest stall {max(calm.longest_stall(), after.longest_stall()):.1f} s, final val accuracy "
            f"{calm_acc:.3f} / {after_acc:.3f}, train accuracy of the last 30 steps {train_acc['calm']:.3f} / "
            f"{train_acc['calm-after']:.3f}",
            f"heavy faults: {heavy.wall_s:.1f} s ({heavy.wall_s / undisturbed_s:.2f}x), longest stall "
            f"{heavy.longest_stall():.1f} s, final val accuracy {heavy_acc:.3f}, "
            f"train accuracy of the last 30 steps {train_acc['faults']:.3f}",
            *(
                f"  at step {s:3d}: {what}, next step {heavy.gap_after(t):.1f} s later, "
                f"{cost:+.1f} s until the next fault"
                for (t, s, what), cost in zip(heavy.events, costs, strict=True)
            ),
            f"  ledger: {len(ledger['trained'])} trained, dropped {dict(_count(ledger['dropped']))}, "
            f"lost in flight {len(lost)}, data indices trained twice {twice}",
        ]
    )
    print(report)
    for line in ["heavy fault load (tests/test_chaos.py, make test-faults):", *report.splitlines()]:
        summary_line(line)
    assert not lost, f"prompts lost in flight: {sorted(lost)}\n{report}"
    assert twice == 0, report
    assert heavy.longest_stall() <= stall_budget, report
    assert heavy.wall_s <= 1.5 * undisturbed_s, report
    assert abs(heavy_acc - (calm_acc + after_acc) / 2) <= VAL_NOISE, report
    assert abs(train_acc["faults"] - (train_acc["calm"] + train_acc["calm-after"]) / 2) <= TRAIN_NOISE, report
