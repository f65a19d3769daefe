"""How many groups a second the bus carries, with no model anywhere: simulated replicas publish real-shaped
trajectory groups (8 samples x 512 tokens with behaviour log-probs, 52 KB encoded) at an offered rate,
real reward service processes score them with the built-in rule verifier, and the learner's side takes
the ready groups through its real consumer, admission check, routing and ledger, and acks them, without
training. For each setting it prints offered and achieved groups/s, p50/p99 latency of each hop, CPU per
group of every process, and the bus's share of a learner step at the H200's step time.

    python bench/bus.py                                   # 1 and 4 partitions side by side, a rate sweep
    python bench/bus.py --partitions 1,4 --rates 100,200,300 --seconds 10 --reward-procs 2
    python bench/bus.py --cluster 3 --partitions 1,4      # a local 3-node cluster, R3 streams

Each setting runs on a NATS server (or cluster) of its own, started fresh.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from rlbus.bus import Bus, LocalNatsServer, Stage
from rlbus.bus.local_cluster import LocalNatsCluster
from rlbus.config import RlbusConfig, save_config
from rlbus.launcher import ServiceProcess
from rlbus.learner.admission import ready_limits, rejection
from rlbus.learner.dispatch import Ledger
from rlbus.learner.gather import Route, route
from rlbus.messages import PromptWork, Sample, SamplingParams, TrajectoryGroup

SAMPLES, TOKENS, VOCAB = 8, 512, 151_936
WARMUP_S = 3.0
H200_STEP_S = (
    1.246  # rlbus async_level=1, 0.5B shape, 64 prompts x 8 samples x 128 tokens (README, bench-e2e)
)
H200_GROUPS_PER_STEP = 64


@dataclass
class Setting:
    partitions: int
    rate: float  # offered groups/s, all replicas together
    cluster: int
    reward_procs: int
    replica_procs: int
    seconds: float


@dataclass
class Result:
    setting: Setting
    offered: float = 0.0
    achieved: float = 0.0
    hop_ms: dict[str, list[float]] = field(default_factory=dict)  # hop -> latencies in the window
    cpu_ms: dict[str, float] = field(default_factory=dict)  # process -> CPU ms per achieved group
    learner_ms_per_group: float = 0.0


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _prompt_id(proc: int, i: int) -> str:
    return f"sim{proc}-{i}"


def _group(run_id: str, proc: int, i: int, samples: list[Sample]) -> TrajectoryGroup:
    work = PromptWork(
        run_id=run_id,
        prompt_id=_prompt_id(proc, i),
        index=proc * 10_000_000 + i,
        step=0,
        min_policy_version=0,
        prompt_ids=[1] * 64,
        meta={"task": "addition", "answer": "42", "bench_t0": time.time()},
        n=SAMPLES,
        sampling=SamplingParams(),
    )
    return TrajectoryGroup(
        work=work, samples=samples, policy_version=0, replica_id=f"sim-{proc}", engine="sim"
    )


def _samples(seed: int) -> list[Sample]:
    rng = np.random.default_rng(seed)
    return [
        Sample(
            response_ids=rng.integers(0, VOCAB, TOKENS).tolist(),
            logprobs=rng.normal(-2.0, 1.0, TOKENS).astype(np.float32),
            text="42" if k % 2 else "41",
        )
        for k in range(SAMPLES)
    ]


def replica_process(
    cfg_path: str, proc: int, rate: float, until: float, window: tuple[float, float], out
) -> None:
    """One process of simulated replicas: publishes groups at `rate`/s until `until` (wall clock), at most
    64 publishes in flight; reports (published in the window, behind schedule at the end)."""
    from rlbus.config import load_config

    cfg = load_config(cfg_path, [])

    async def main() -> tuple[int, int]:
        samples = _samples(proc)
        in_window = 0
        async with Bus.connect(cfg, name=f"sim-{proc}", ensure=False) as bus:
            gate = asyncio.Semaphore(64)
            tasks: set[asyncio.Task] = set()

            async def one(i: int) -> None:
                nonlocal in_window
                try:
                    group = _group(cfg.run.id, proc, i, samples)
                    await bus.publish(Stage.TRAJECTORIES, group, msg_id=f"{_prompt_id(proc, i)}:traj")
                    if window[0] <= float(group.work.meta["bench_t0"]) < window[1]:
                        in_window += 1
                finally:
                    gate.release()

            i, start = 0, time.time()
            while time.time() < until:
                due = start + i / rate
                if due > time.time():
                    await asyncio.sleep(due - time.time())
                await gate.acquire()
                task = asyncio.create_task(one(i))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                i += 1
            await asyncio.gather(*tasks)
            behind = int((time.time() - start) * rate) - i
        return in_window, behind

    out.put((proc, *asyncio.run(main())))


async def learner_side(
    cfg: RlbusConfig, ledger: Ledger, window: tuple[float, float], until: float, res: Result
):
    """The learner's consumer, admission and routing on every ready group, the ledger settled, each acked;
    returns how many of the groups offered in the window arrived (by `until`) and the learner process's CPU
    seconds in the window."""
    limits = ready_limits(cfg, VOCAB)
    taken = 0
    cpu0 = cpu1 = None
    async with Bus.connect(cfg, name="learner-side", ensure=False) as bus:
        consumer = await bus.consumer(Stage.READY, "learner", ack_wait_s=600)
        while time.time() < until:
            now = time.time()
            if cpu0 is None and now >= window[0]:
                cpu0 = time.process_time()
            if cpu1 is None and now >= window[1]:
                cpu1 = time.process_time()
            got = await consumer.fetch(batch=64, timeout=0.5)
            batch: list = []
            for d in got:
                group = d.message
                pid = group.scored.trajectories.work.prompt_id
                reason = rejection(group, limits, ledger.dispatched.get(pid, -1))
                where = route(
                    group,
                    version=0,
                    known=pid in ledger.dispatched,
                    settled_or_batched=ledger.is_settled(pid),
                    async_level=1,
                    dynamic_sampling=False,
                    batch_full=False,
                )
                if reason is None and where is Route.BATCH:
                    ledger.trained[pid] = 0
                batch.append(d)
                arrived = time.time()
                t0 = float(group.scored.trajectories.work.meta["bench_t0"])
                if window[0] <= t0 < window[1]:  # offered in the window: counted whenever it arrives
                    taken += 1
                    stored = d.raw.metadata.timestamp.timestamp()
                    res.hop_ms.setdefault("replica -> ready stored", []).append((stored - t0) * 1e3)
                    res.hop_ms.setdefault("ready stored -> learner", []).append((arrived - stored) * 1e3)
                    res.hop_ms.setdefault("end to end", []).append((arrived - t0) * 1e3)
            await asyncio.gather(*(d.ack() for d in batch))
        await consumer.close()
    return taken, (cpu1 or time.process_time()) - (cpu0 or 0.0)


def _start_bus(tmp: Path, cluster: int) -> tuple[str, LocalNatsServer | LocalNatsCluster, list[int]]:
    if cluster > 1:
        nodes = LocalNatsCluster(tmp / "nats", cluster, 8 * 1024 * 1024).start()
        return nodes.url, nodes, [s.pid for s in nodes.servers if s.pid]
    server = LocalNatsServer(tmp / "nats", max_payload_bytes=8 * 1024 * 1024).start()
    return server.url, server, [server.pid] if server.pid else []


async def _ready_rewards(cfg: RlbusConfig, n: int, timeout_s: float = 120.0) -> None:
    async with Bus.connect(cfg, name="bench-probe", ensure=False) as bus:
        state = await bus.state()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            beats = await state.heartbeats("reward")
            if sum(1 for b in beats if b.status == "ready") >= n:
                return
            await asyncio.sleep(0.2)  # polling the reward services' heartbeats
    raise RuntimeError(f"{n} reward services did not become ready in {timeout_s:.0f} s")


def run_setting(s: Setting, tmp: Path) -> Result:
    """One setting end to end on a bus of its own."""
    res = Result(s)
    url, nats, nats_pids = _start_bus(tmp, s.cluster)
    rewards: list[ServiceProcess] = []
    sims: list[mp.Process] = []
    try:
        run_id = f"busbench{os.getpid()}"
        cfg = RlbusConfig(
            run={"id": run_id, "dir": tmp / "runs"},
            bus={"url": url, "partitions": s.partitions, "replicas": 3 if s.cluster >= 3 else 1},
            reward={"type": "task"},
            data={"max_response_length": TOKENS},
            algorithm={"use_kl_in_reward": False},
            actor={"use_kl_loss": False},
        )
        cfg_path = save_config(cfg, tmp / "config.yaml")
        asyncio.run(_ensure(cfg))
        for k in range(s.reward_procs):
            proc = ServiceProcess(
                f"reward-{k}",
                "reward",
                ["--config", str(cfg_path), "--instance-id", f"reward-{k}"],
                tmp / "logs" / f"reward-{k}.log",
            )
            proc.env.setdefault("OMP_NUM_THREADS", "1")
            rewards.append(proc.start())
        asyncio.run(_ready_rewards(cfg, s.reward_procs))
        t_start = time.time() + 1.0
        window = (t_start + WARMUP_S, t_start + WARMUP_S + s.seconds)
        until = window[1] + 0.5
        per_proc = int(s.rate * (until - t_start) / s.replica_procs * 1.5) + 100
        ledger = Ledger()
        for p in range(s.replica_procs):
            for i in range(per_proc):
                ledger.dispatched[_prompt_id(p, i)] = p * 10_000_000 + i
        out: mp.Queue = mp.get_context("spawn").Queue()
        sims = [
            mp.get_context("spawn").Process(
                target=replica_process,
                args=(str(cfg_path), p, s.rate / s.replica_procs, until, window, out),
            )
            for p in range(s.replica_procs)
        ]
        for p in sims:
            p.start()
        pids = {
            f"nats-server x{len(nats_pids)}": nats_pids,
            "reward": [r.proc.pid for r in rewards if r.proc],
        }
        cpu_at = asyncio.run(_measure(cfg, ledger, window, until + 2.0, res, pids, sims))
        reports = [out.get(timeout=60) for _ in sims]
        res.offered = sum(r[1] for r in reports) / s.seconds
        res.cpu_ms = cpu_at
        return res
    finally:
        for p in sims:
            p.join(timeout=30)
        for r in rewards:
            r.stop(timeout=10)
        nats.stop()


async def _ensure(cfg: RlbusConfig) -> None:
    async with Bus.connect(cfg, name="bench-setup"):
        pass


async def _measure(
    cfg, ledger, window, until, res: Result, pids: dict[str, list[int]], sims
) -> dict[str, float]:
    """Runs the learner's side through the window, reading every process's CPU clock at its ends."""
    groups: dict[str, list[int]] = {**pids, "replicas (simulated)": [p.pid for p in sims]}
    before: dict[str, float] = {}

    async def at_window_start() -> None:
        await asyncio.sleep(max(window[0] - time.time(), 0))
        before.update({name: sum(_cpu_s(p) for p in ps) for name, ps in groups.items()})

    async def at_window_end() -> dict[str, float]:
        await asyncio.sleep(max(window[1] - time.time(), 0))
        return {name: sum(_cpu_s(p) for p in ps) for name, ps in groups.items()}

    start_task = asyncio.create_task(at_window_start())
    end_task = asyncio.create_task(at_window_end())
    taken, learner_cpu = await learner_side(cfg, ledger, window, until, res)
    await start_task
    after = await end_task
    seconds = window[1] - window[0]
    res.achieved = taken / seconds
    per_group = {name: (after[name] - before[name]) * 1e3 / max(taken, 1) for name in groups}
    per_group["learner side"] = learner_cpu * 1e3 / max(taken, 1)
    res.learner_ms_per_group = per_group["learner side"]
    return per_group


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def report(results: list[Result], step_s: float, groups_per_step: int) -> str:
    lines = []
    for r in results:
        s = r.setting
        ratio = r.achieved / r.offered if r.offered else float("nan")
        lines.append(
            f"partitions {s.partitions}, cluster {s.cluster}, {s.reward_procs} reward procs: offered "
            f"{r.offered:7.1f} groups/s, achieved {r.achieved:7.1f} ({ratio:.3f})"
        )
        for hop, values in r.hop_ms.items():
            lines.append(f"    {hop:<26} p50 {_pct(values, 50):7.1f} ms   p99 {_pct(values, 99):7.1f} ms")
        cpu = ", ".join(f"{name} {ms:.2f}" for name, ms in r.cpu_ms.items())
        lines.append(f"    CPU ms per group: {cpu}")
        share = r.learner_ms_per_group * groups_per_step / 1e3 / step_s
        lines.append(
            f"    the bus's share of an H200 step ({groups_per_step} groups, {step_s:.3f} s): "
            f"{share * 100:.2f}% of the learner's time"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--partitions", default="1,4", help="comma-separated partition counts, side by side")
    ap.add_argument("--rates", default="50,100,200,300", help="offered groups/s to sweep")
    ap.add_argument("--cluster", type=int, default=1, help="NATS servers (1, or 3 for a local cluster, R3)")
    ap.add_argument("--reward-procs", type=int, default=2)
    ap.add_argument("--replica-procs", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=8.0, help="measured window after a warm-up")
    ap.add_argument("--step-s", type=float, default=H200_STEP_S)
    ap.add_argument("--groups-per-step", type=int, default=H200_GROUPS_PER_STEP)
    args = ap.parse_args()
    results = []
    for rate in [float(r) for r in args.rates.split(",")]:
        for parts in [int(p) for p in args.partitions.split(",")]:
            setting = Setting(parts, rate, args.cluster, args.reward_procs, args.replica_procs, args.seconds)
            with tempfile.TemporaryDirectory(prefix="busbench") as tmp:
                results.append(run_setting(setting, Path(tmp)))
            print(report(results[-1:], args.step_s, args.groups_per_step), flush=True)
    print("\n# side by side")
    print(report(results, args.step_s, args.groups_per_step))


if __name__ == "__main__":
    main()
