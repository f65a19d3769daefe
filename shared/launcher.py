"""`rlbus up`: NATS (found or started), then every service as its own OS process, with a live progress line."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, cast

import yaml

from rlbus.config import RlbusConfig, save_config
from rlbus.gpu_sharing import find_control, missing_control_problem, start_for_run
from rlbus.logs import get_logger, setup_logging
from rlbus.metrics_log import MetricsTail, progress_line
from rlbus.notices import NOTICES_FILE, read_notices
from rlbus.preforked import ForkedService, start_server
from rlbus.refusal_hold import ON_REFUSAL_ENV
from rlbus.service import EXIT_REFUSED
from rlbus.supervisor import Action, Supervisor
from rlbus.verl_metric_names import is_validation_row

if TYPE_CHECKING:
    from rlbus.bus import LocalNatsServer
    from rlbus.bus.local_cluster import LocalNatsCluster
    from rlbus.bus.roles import RoleUser

log = get_logger("launcher")

TEND_EVERY_S = 0.1  # how soon a dead service is seen and restarted (past its backoff)
CONSOLE_EVERY_S = 1.0  # the progress line and the services' notices


SERVICES_CONFIG = "config.set.yaml"  # the run's config as the services load it (only the keys set)


def run_dir_of(cfg: RlbusConfig) -> Path:
    return Path(cfg.run.dir) / cfg.run.id


@dataclass
class ServiceProcess:
    """One service started as `python -m rlbus.cli <service> --config FILE`, logging to its own file."""

    name: str
    service: str
    args: list[str]
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)
    command: list[str] | None = None  # what runs instead of `python -m rlbus.cli <service>` (torchrun)
    proc: subprocess.Popen | ForkedService | None = None
    started_at: float | None = None  # time.monotonic() at the last start
    preforked: bool = False  # forked from the preloaded server (rlbus.preforked), not a fresh interpreter

    @property
    def pid_path(self) -> Path:
        """Where the running process's pid is written, beside its log (for operators and tests)."""
        return self.log_path.with_suffix(".pid")

    def start(self) -> ServiceProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.env}
        if self.preforked and self.command is None:
            self.proc = ForkedService([self.service, *self.args], env, self.log_path)
        else:
            out = open(self.log_path, "ab")  # noqa: SIM115 - owned by the child for its lifetime
            self.proc = subprocess.Popen(
                [*(self.command or [sys.executable, "-m", "rlbus.cli", self.service]), *self.args],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
            out.close()
        self.started_at = time.monotonic()
        self.pid_path.write_text(f"{self.proc.pid}\n")
        return self

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout: float = 15.0) -> int | None:
        """SIGTERM (graceful: finish the current item, leave the rest on the bus), then SIGKILL."""
        self.ask_to_stop()
        return self.wait_stopped(time.monotonic() + timeout)

    def ask_to_stop(self) -> None:
        """SIGTERM, without waiting: `stop_all` signals every service before it waits for any."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def wait_stopped(self, deadline: float) -> int | None:
        """Waits until `deadline` (time.monotonic()) for the process to end, then SIGKILLs it."""
        if self.proc is None:
            return None
        try:
            self.proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)


def stop_all(procs: list[ServiceProcess], timeout: float = 15.0) -> None:
    """Every service signalled first, then waited for under one deadline: a run's stop takes its slowest
    service's time, not the sum of all of theirs (a learner still loading its model took 4 s to answer)."""
    for p in procs:
        p.ask_to_stop()
    deadline = time.monotonic() + timeout
    for p in procs:
        p.wait_stopped(deadline)


def learner_command(cfg: RlbusConfig) -> list[str] | None:
    """`trainer.n_gpus_per_node` > 1: the learner is a torchrun job of that many ranks on this host
    (FSDP2 over them; rank 0 talks to the bus). None: one plain learner process."""
    ranks = cfg.trainer.n_gpus_per_node
    if ranks <= 1:
        return None
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(ranks),
        "-m",
        "rlbus.learner.main",
    ]


def rollout_gpu(replica: int, learner_gpus: int, visible: int) -> int | None:
    """The GPU of rollout replica `replica` when the learner holds GPUs 0..learner_gpus-1 of `visible`:
    the GPUs after the learner's, round robin; with none left, the learner's own, round robin (weights
    then go by CUDA IPC to the replicas on rank 0's GPU and by NCCL to the others). None: no GPU here."""
    if visible == 0:
        return None
    free = visible - learner_gpus
    return learner_gpus + replica % free if free > 0 else replica % visible


def service_processes(
    cfg: RlbusConfig, config_path: Path, run_dir: Path, gpus: int = 0
) -> list[ServiceProcess]:
    """Consumers first (reward, ref, rollout replicas), the learner last: it starts dispatching at once."""
    base = ["--config", str(config_path)]
    logs = run_dir / "logs"
    procs = [ServiceProcess("reward", "reward", [*base, "--instance-id", "reward-0"], logs / "reward.log")]
    if cfg.needs_ref:
        procs.append(ServiceProcess("ref", "ref", [*base, "--instance-id", "ref-0"], logs / "ref.log"))
    learner_gpus = cfg.trainer.n_gpus_per_node
    for i in range(cfg.rollout.replicas):
        rid = f"rollout-{i}"
        proc = ServiceProcess(rid, "rollout", [*base, "--replica-id", rid], logs / f"{rid}.log")
        gpu = rollout_gpu(i, learner_gpus, gpus) if learner_gpus > 1 else None
        if gpu is not None and cfg.rollout.device in ("auto", "cuda"):
            proc.args += [f"rollout.device=cuda:{gpu}"]
        procs.append(proc)
    procs.append(
        ServiceProcess("learner", "learner", base, logs / "learner.log", command=learner_command(cfg))
    )
    return procs


def bus_users(cfg: RlbusConfig, procs: list[ServiceProcess]) -> list[RoleUser]:
    """One NATS user per service process (by its instance id), and the reader."""
    from rlbus.bus.roles import Role, make_users
    from rlbus.bus.subjects import RunNames

    return make_users(
        RunNames(cfg.run.id, cfg.bus.partitions), {instance_of(p): cast(Role, p.service) for p in procs}
    )


def instance_of(p: ServiceProcess) -> str:
    """The instance id a service process runs as (the learner's own is not fixed: its role covers it)."""
    for flag in ("--instance-id", "--replica-id"):
        if flag in p.args:
            return p.args[p.args.index(flag) + 1]
    return p.service


def role_env(users: list[RoleUser], p: ServiceProcess) -> dict[str, str]:
    """The environment that makes `p` connect as its own user."""
    user = next(u for u in users if u.instance == instance_of(p))
    return {"RLBUS_BUS__USER": user.user, "RLBUS_BUS__PASSWORD": user.password}


def prepare_run(
    cfg: RlbusConfig, fresh: bool, users: list[RoleUser] | None = None
) -> tuple[Path, Path, LocalNatsServer | LocalNatsCluster | None]:
    """Run dir, resolved config file (with the bus URL filled in) and the NATS server we started, if any.
    With `users`, the server is the run's own, and only they may connect (each with its role's rights)."""
    from rlbus.bus import resolve_bus_url
    from rlbus.bus.roles import authorization_block, write_reader
    from rlbus.bus.run_server import start_run_server
    from rlbus.bus.subjects import RunNames

    run_dir = run_dir_of(cfg)
    if fresh and run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    server: LocalNatsServer | LocalNatsCluster | None
    if users is not None and not cfg.bus.url:
        write_reader(users, run_dir / "nats")
        auth = authorization_block(users, RunNames(cfg.run.id, cfg.bus.partitions), cfg.needs_ref)
        reader = next(u for u in users if u.role == "reader")
        url, server = start_run_server(cfg.bus, run_dir, auth, (reader.user, reader.password))
    elif not cfg.bus.url and cfg.bus.cluster_size > 1:  # an open cluster of the run's own (bus.roles=false)
        url, server = start_run_server(cfg.bus, run_dir)
    else:
        url, server = resolve_bus_url(cfg.bus, run_dir)
    resolved = cfg.model_copy(deep=True)
    resolved.bus.url = url
    if "jsonl" not in resolved.trainer.logger:  # the progress lines on this terminal are read from it
        resolved.trainer.logger = [*resolved.trainer.logger, "jsonl"]
    if fresh:
        resolved.trainer.resume_mode = "disable"
    save_config(resolved, run_dir / "config.yaml")  # every key, resolved: for people and tools to read
    # what the services load: the keys the user set and the launcher's own, so that their start-up
    # warnings are about the user's keys (every key in the file would count as set by the user)
    chosen = cfg.model_dump(mode="json", exclude_unset=True)
    chosen.setdefault("bus", {})["url"] = url
    trainer = chosen.setdefault("trainer", {})
    trainer["logger"] = resolved.trainer.logger
    if fresh:
        trainer["resume_mode"] = "disable"
    config_path = run_dir / SERVICES_CONFIG
    config_path.write_text(yaml.safe_dump(chosen, sort_keys=False))
    return run_dir, config_path, server


# A GPU's driver leaves one of these: NVIDIA's (also inside a container given GPUs), AMD's ROCm, WSL's.
GPU_DRIVER_PATHS = ("/proc/driver/nvidia", "/dev/nvidiactl", "/dev/kfd", "/dev/dxg")


def gpu_driver_installed() -> bool:
    return any(Path(p).exists() for p in GPU_DRIVER_PATHS)


def visible_gpus() -> int:
    """The GPUs torch sees here. Where no GPU driver is installed there are none, and torch is not imported:
    its import (3-8 s of CPU on the 2-core box) would compete with the preloading server's, which every
    service, and so a refusal at start, waits for."""
    if not gpu_driver_installed():
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def check_loggers(cfg: RlbusConfig) -> str | None:
    """A logger whose library is missing is refused before anything starts (not a traceback in a log)."""
    import importlib.util

    if "wandb" in cfg.trainer.logger and importlib.util.find_spec("wandb") is None:
        return (
            "trainer.logger names wandb, which is not installed: pip install 'rlbus[wandb]' (or wandb), "
            "or drop it from trainer.logger"
        )
    return None


def check_placement(cfg: RlbusConfig, gpus: int) -> str | None:
    """What the config alone makes impossible on this box, as the message to print (None when fine)."""
    from rlbus.weight_transport import PlacementError, check_config_placement

    try:
        check_config_placement(cfg.trainer.weight_sync_backend, cfg.trainer.device, cfg.rollout.device, gpus)
    except PlacementError as exc:
        return str(exc)
    return None


def start_problems(cfg: RlbusConfig, gpus: int) -> list[str]:
    """Everything that would stop the run at its start (rlbus.preflight and the checks above), as lines."""
    from rlbus.preflight import preflight

    mps = missing_control_problem(cfg.run.gpu_sharing, find_control())
    found = [p for p in (check_loggers(cfg), check_placement(cfg, gpus), mps) if p]
    return found + [str(p) for p in preflight(cfg)]


def gpu_env(gpus: int) -> dict[str, str]:
    """Learner and rollout share a GPU on a one-GPU box: expandable segments keep either from holding
    fragmented blocks the other needs (the user's own setting wins)."""
    if gpus == 0 or "PYTORCH_CUDA_ALLOC_CONF" in os.environ or "PYTORCH_ALLOC_CONF" in os.environ:
        return {}
    return {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}


def cpu_thread_env(cfg: RlbusConfig, procs: list[ServiceProcess], gpus: int) -> dict[str, dict[str, str]]:
    """``OMP_NUM_THREADS`` per service when several compute on this host's CPU cores: the cores are split
    between them (torchrun does the same for its ranks), where each torch process would otherwise start
    one thread per core and they would preempt each other. On the 2-core box the embedded demo's step went
    from 0.222 s to 0.174 s (`bench/e2e_gpu.py --device cpu`). The reward service gets one thread; the
    user's own ``OMP_NUM_THREADS`` wins."""
    if "OMP_NUM_THREADS" in os.environ:
        return {}
    on_cpu = {
        "learner": gpus == 0 or cfg.trainer.device == "cpu",
        "rollout": gpus == 0 or cfg.rollout.device == "cpu",
        "ref": gpus == 0 or (cfg.ref.device or cfg.trainer.device) == "cpu",
    }
    compute = [p for p in procs if on_cpu.get(p.service, False)]
    if not compute:
        return {}
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    per = str(max(1, cores // len(compute)))
    out = {p.name: {"OMP_NUM_THREADS": per} for p in compute}
    out.update({p.name: {"OMP_NUM_THREADS": "1"} for p in procs if p.service == "reward"})
    return out


@dataclass
class Outcome:
    """How a run ended, as far as the launcher is concerned."""

    rc: int | None = None
    refused: ServiceProcess | None = None  # its configuration cannot work: a restart would loop forever
    gave_up: tuple[ServiceProcess, int] | None = None  # kept dying: (service, last exit code)


class Console:
    """What the `rlbus up` terminal shows: a progress line per step and the services' notices, each once."""

    def __init__(self, cfg: RlbusConfig, run_dir: Path) -> None:
        self.total_steps = cfg.trainer.total_training_steps
        self.run_dir = run_dir
        self.metrics = MetricsTail(run_dir)
        notices_file = run_dir / NOTICES_FILE
        # a resume's old notices were said already
        self.notices_at = notices_file.stat().st_size if notices_file.exists() else 0
        self.said: set[str] = set()

    def update(self) -> None:
        for row in self.metrics.new_rows():
            if not is_validation_row(row):  # verl's held-out names, at their own step: shown in the next line
                print(progress_line(int(row["step"]), self.total_steps, row), flush=True)
        rows, self.notices_at = read_notices(self.run_dir, self.notices_at)
        for row in rows:
            text = f"rlbus: {row.get('service', '?')}: {row.get('text', '')}"
            if text not in self.said:  # a wait repeated every 10 s is said once
                self.said.add(text)
                print(text, file=sys.stderr, flush=True)


def tend(procs: list[ServiceProcess], supervisor: Supervisor, cfg: RlbusConfig) -> Outcome | None:
    """One look at every service: the learner done ends the run; a dead service is restarted (the
    learner from its last checkpoint), or ends the run when it refused its config or kept dying."""
    learner = procs[-1]
    if learner.proc is not None and learner.proc.poll() == 0:  # the run is done
        return Outcome(rc=0)
    for p in procs:
        code = p.proc.poll() if p.proc is not None else None
        action = supervisor.on_exit(p.name, code, time.monotonic(), p.started_at)
        if action is Action.REFUSED:
            log.error(
                "service refused its configuration; stopping the run", service=p.name, log=str(p.log_path)
            )
            return Outcome(rc=EXIT_REFUSED, refused=p)
        if action is Action.STOP:
            return Outcome(rc=int(code or 1))
        if action is Action.GIVE_UP:
            return Outcome(rc=int(code or 1), gave_up=(p, int(code or 1)))
        if action is Action.RESTART:
            n = supervisor.restarts[p.name]
            log.warning(
                "service exited; restarting it",
                service=p.name,
                rc=code,
                restart=n,
                max_restarts=cfg.run.max_restarts,
                log=str(p.log_path),
            )
            print(
                f"rlbus: {p.name} exited with {code}; restarting it ({n}/{cfg.run.max_restarts})"
                + (", from its last checkpoint" if p is learner else ""),
                file=sys.stderr,
                flush=True,
            )
            p.start()
    return None


def why(log_path: Path) -> str:
    """': <the first error of the service's last start>' for the console's last line, or ''."""
    from rlbus.log_reasons import first_error

    reason = first_error(log_path)
    return f": {reason}" if reason else ""


def say_outcome(outcome: Outcome, learner: ServiceProcess, cfg: RlbusConfig) -> None:
    """The last line a user reads when the run did not end well: which service, why, which log."""
    if outcome.refused is not None:
        where = outcome.refused.log_path
        print(
            f"rlbus: {outcome.refused.name} refused its configuration{why(where)}; see {where}",
            file=sys.stderr,
            flush=True,
        )
    elif outcome.gave_up is not None:
        p, code = outcome.gave_up
        print(
            f"rlbus: {p.name} kept dying (exit {code} after {cfg.run.max_restarts} restarts, "
            f"run.max_restarts={cfg.run.max_restarts}){why(p.log_path)}; stopping the run; see {p.log_path}",
            file=sys.stderr,
            flush=True,
        )
    elif outcome.rc == 130:  # Ctrl-C or SIGTERM, to `rlbus up` or to the learner: a stop, not a failure
        print(f"rlbus: stopped; logs in {learner.log_path.parent}", file=sys.stderr, flush=True)
    elif outcome.rc not in (0, None):
        print(f"rlbus: learner exited with {outcome.rc}; see {learner.log_path}", file=sys.stderr, flush=True)


def launch(cfg: RlbusConfig, fresh: bool = False) -> int:
    setup_logging(cfg.logging.level, cfg.logging.json_logs, service="launcher")
    if cfg.run.service_start == "fork":
        # its imports overlap the launcher's own (torch for the GPU count, where a GPU driver is installed)
        # and the run's preparation; a refused run leaves it to finish them and exit on its own
        start_server()
    gpus = visible_gpus()
    refused = start_problems(cfg, gpus)
    if refused:
        for problem in refused:
            print(f"rlbus: refused: {problem}", file=sys.stderr, flush=True)
        return EXIT_REFUSED
    from rlbus.config.warnings import inert_key_warnings

    for warning in inert_key_warnings(cfg):
        print(f"rlbus: warning: {warning}", file=sys.stderr, flush=True)
    from rlbus.config.verl_defaults import defaults_block

    if block := defaults_block(cfg):
        print(f"rlbus: {block}", file=sys.stderr, flush=True)
    with_roles = cfg.bus.roles and not cfg.bus.url
    planned = service_processes(cfg, run_dir_of(cfg) / SERVICES_CONFIG, run_dir_of(cfg), gpus)
    users = bus_users(cfg, planned) if with_roles else None
    run_dir, config_path, server = prepare_run(cfg, fresh, users)
    procs = service_processes(cfg, config_path, run_dir, gpus)
    threads = cpu_thread_env(cfg, procs, gpus)
    for p in procs:
        if users is not None:
            p.env.update(role_env(users, p))
        p.env.update(gpu_env(gpus))
        p.env["PYTHONSAFEPATH"] = "1"  # a folder named rlbus/ where the user stands must not hide the package
        p.env[ON_REFUSAL_ENV] = "exit"  # a refusal must reach this supervisor (a held child never would)
        p.env.update(threads.get(p.name, {}))
        p.preforked = cfg.run.service_start == "fork"
    stopping = False

    def _stop(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True

    old_int = signal.signal(signal.SIGINT, _stop)
    old_term = signal.signal(signal.SIGTERM, _stop)
    print(f"rlbus: run {cfg.run.id} in {run_dir} (logs in {run_dir / 'logs'})", flush=True)
    console = Console(cfg, run_dir)
    supervisor = Supervisor(cfg.run.max_restarts, cfg.run.restart_backoff_s)
    outcome = Outcome(rc=130)  # stopped by a signal, unless the loop says otherwise
    mps = None
    try:  # the MPS daemon starts inside: whatever ends the run, the finally quits it
        mps = start_for_run(cfg, gpus, run_dir)  # services sharing a GPU run side by side under it
        for p in procs:
            p.env.update(mps.service_env(cfg, p.service))
            p.start()
        console_at = time.monotonic()
        while not stopping:
            time.sleep(TEND_EVERY_S)  # a dead service is seen within this (polls are cheap)
            if time.monotonic() - console_at >= CONSOLE_EVERY_S:
                console.update()
                console_at = time.monotonic()
            ended = tend(procs, supervisor, cfg)
            if ended is not None:
                outcome = ended
                break
    finally:
        stop_all(procs)
        if server is not None:
            server.stop()
        if mps is not None:
            mps.stop()
        signal.signal(signal.SIGINT, old_int)
        signal.signal(signal.SIGTERM, old_term)
    console.update()
    say_outcome(outcome, procs[-1], cfg)
    return int(outcome.rc or 0)
