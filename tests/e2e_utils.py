"""Starts a real run as separate OS processes (the same way `rlbus up` does) and reads back its results."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from rlbus.config import RlbusConfig, load_config, save_config
from rlbus.launcher import ServiceProcess, service_processes
from rlbus.messages import PromptWork, SamplingParams
from rlbus.metrics_log import read_metrics

FAST = [
    "trainer.logger=[jsonl]",
    "bus.ack_wait_s=8",
    "trainer.replica_timeout_s=8",
    "trainer.weight_push_timeout_s=30",
    "trainer.batch_timeout_s=120",
    "logging.level=info",
]


def prompt_work(run_id: str, i: int = 0) -> PromptWork:
    """A minimal, valid work item (prompt id `p<i>`): for tests of the bus itself, not of generation."""
    return PromptWork(
        run_id=run_id,
        prompt_id=f"p{i}",
        index=i,
        step=0,
        min_policy_version=0,
        prompt_ids=[1],
        n=1,
        sampling=SamplingParams(),
    )


def up_command(tmp_path: Path, nats_url: str | None, run_id: str, *overrides: str) -> list[str]:
    """`rlbus up` on the test's NATS (None: a server of the run's own, one user per process) and run dir;
    later overrides win over the defaults given here."""
    return [
        sys.executable,
        "-m",
        "rlbus.cli",
        "up",
        *([f"bus.url={nats_url}"] if nats_url else []),
        f"run.id={run_id}",
        f"run.dir={tmp_path / 'runs'}",
        "trainer.logger=[jsonl]",
        *overrides,
    ]


def rlbus_up(
    tmp_path: Path, nats_url: str, run_id: str, *overrides: str, timeout: float
) -> subprocess.CompletedProcess:
    """`rlbus up` as a user runs it (console output captured), to the end."""
    return subprocess.run(
        up_command(tmp_path, nats_url, run_id, *overrides),
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=tmp_path,
    )


def running_services(run_dir: Path) -> dict[str, int]:
    """The live services `rlbus up` runs in `run_dir`, from the pid file it writes beside each log:
    name -> pid, a rollout replica by its replica id (rollout-0, rollout-1, ...)."""
    out = {}
    for pid_file in (run_dir / "logs").glob("*.pid"):
        try:
            pid = int(pid_file.read_text())
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, ValueError):
            continue  # gone, or being rewritten
        if state not in ("Z", "X"):  # a dead child its parent has not reaped yet is not a service
            out[pid_file.stem] = pid
    return out


def wait_until(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Polls an observable condition until it holds; fails after `timeout_s` naming what it waited for."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


def make_config(nats_url: str, run_id: str, tmp_path: Path, overrides: list[str]) -> RlbusConfig:
    return load_config(
        None, [f"bus.url={nats_url}", f"run.id={run_id}", f"run.dir={tmp_path / 'runs'}", *FAST, *overrides]
    )


class Run:
    def __init__(self, cfg: RlbusConfig) -> None:
        self.cfg = cfg
        self.run_dir = Path(cfg.run.dir) / cfg.run.id
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.config_path = save_config(cfg, self.run_dir / "config.yaml")
        self.procs: list[ServiceProcess] = service_processes(cfg, self.config_path, self.run_dir)
        for p in self.procs:
            p.env.setdefault("OMP_NUM_THREADS", "1")

    def __enter__(self) -> Run:
        for p in self.procs:
            p.start()
        return self

    def __exit__(self, *exc: object) -> None:
        for p in reversed(self.procs):
            p.stop(timeout=10)

    def proc(self, name: str) -> ServiceProcess:
        return next(p for p in self.procs if p.name == name)

    @property
    def learner(self) -> ServiceProcess:
        return self.proc("learner")

    def metrics(self) -> list[dict]:
        return read_metrics(self.run_dir)

    def wait_for_step(self, step: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            rows = self.metrics()
            if rows and rows[-1]["step"] >= step:
                return
            if not self.learner.alive:
                raise AssertionError(f"learner exited early:\n{self.logs('learner')}")
            time.sleep(0.5)
        raise AssertionError(f"step {step} not reached in {timeout_s}s:\n{self.logs('learner')}")

    def wait_learner(self, timeout_s: float) -> int:
        assert self.learner.proc is not None
        try:
            rc = self.learner.proc.wait(timeout_s)
        except Exception as exc:
            raise AssertionError(f"learner did not finish in {timeout_s}s:\n{self.logs('learner')}") from exc
        return rc

    def logs(self, name: str, tail: int = 60) -> str:
        path = self.proc(name).log_path
        lines = path.read_text(errors="replace").splitlines() if path.exists() else []
        return "\n".join(lines[-tail:])

    def ledger(self) -> dict:
        return json.loads((self.run_dir / "ledger.json").read_text())


def rollout_groups(rollout_dir: Path, step: int) -> list[list[dict]]:
    """The samples a learner wrote to `trainer.rollout_data_dir` for one step, grouped by prompt (`uid`)."""
    from rlbus.learner.rollout_data import read_rollout_data

    groups: dict[str, list[dict]] = {}
    for record in read_rollout_data(rollout_dir / f"{step}.jsonl"):
        groups.setdefault(record["uid"], []).append(record)
    return list(groups.values())


def checkpoint_weights(run_dir: Path, step: int) -> dict:
    """The policy weights a run's checkpoint of `step` holds (`trainer.save_freq`), as plain CPU tensors."""
    from rlbus.learner.checkpoint import checkpoint_root, load_model_state, step_dir

    return load_model_state(step_dir(checkpoint_root(run_dir), step))
