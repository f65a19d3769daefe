"""Services that share one GPU, time-sliced by the driver or side by side under NVIDIA's Multi-Process Service.

Without MPS the GPU time-slices between processes: the learner's kernels and a replica's never run at the
same time, so at async_level >= 1 on one GPU a step costs about the sum of the two services' GPU times.
Under MPS their kernels share the GPU's SMs as one process's streams would. With `run.gpu_sharing=mps`
(or `auto` where `nvidia-cuda-mps-control` is installed) `rlbus up` starts an MPS control daemon of its own
for the run when the learner and a replica share a GPU (pipe and log folders of its own, so it neither finds
nor disturbs another), and quits it at the end. The default stays time-sliced: at the 0.5B shape on an H100
MPS gave the same step time with a worse p99 (README, "Sharing one GPU"). `mps_plan` decides; `MpsDaemon`
is the shell.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from rlbus.config.sections import GpuSharing
from rlbus.logs import get_logger

if TYPE_CHECKING:
    from rlbus.config import RlbusConfig

log = get_logger("rlbus.gpu_sharing")

MPS_CONTROL = "nvidia-cuda-mps-control"
PIPES_RECORD = "pipe-folder"  # in the run's logs/mps while its daemon runs: where its sockets are


@dataclass(frozen=True)
class MpsPlan:
    """Whether the run's services go under an MPS daemon of the run's own, and why (for the log)."""

    start: bool
    reason: str


def mps_plan(setting: GpuSharing, shared_gpu: bool, control: str | None, outside_daemon: bool) -> MpsPlan:
    """`setting` (run.gpu_sharing), whether the learner and a replica share a GPU, the control binary's path
    (None: not installed) and whether the user already runs the services under an MPS daemon of their own
    (CUDA_MPS_PIPE_DIRECTORY set): that daemon is theirs to keep, and the services find it through it."""
    if setting == "time_slice":
        return MpsPlan(False, "run.gpu_sharing=time_slice")
    if outside_daemon:
        return MpsPlan(False, "CUDA_MPS_PIPE_DIRECTORY is set: the services use that MPS daemon")
    if not shared_gpu:
        return MpsPlan(False, "no GPU is shared by the learner and a replica")
    if control is None:  # run.gpu_sharing=mps was refused at start (`missing_control_problem`)
        return MpsPlan(False, f"{MPS_CONTROL} is not installed: the GPU time-slices between the services")
    return MpsPlan(True, "the learner and a replica share a GPU")


class MpsDaemon:
    """An MPS control daemon for one run: started before the services, quit after them."""

    def __init__(self, run_dir: Path, control: str) -> None:
        # its sockets live in the pipe folder: a short path under the temp folder (a Unix socket's path has
        # at most 107 bytes, which a run folder deep in a home directory may pass); its logs beside the run's
        self.pipes = Path(tempfile.mkdtemp(prefix="rlbus-mps-"))
        self.logs = run_dir / "logs" / "mps"
        self.control = control
        self.running = False

    @property
    def env(self) -> dict[str, str]:
        """What a service needs to find this daemon."""
        return self._env(self.pipes)

    def _env(self, pipes: Path) -> dict[str, str]:
        return {"CUDA_MPS_PIPE_DIRECTORY": str(pipes), "CUDA_MPS_LOG_DIRECTORY": str(self.logs)}

    def start(self) -> bool:
        """Start it (`-d`: it daemonizes and returns); False, with the reason logged, when it would not.
        A daemon an earlier launcher of this run left behind (killed before it could quit it) is quit first."""
        self.logs.mkdir(parents=True, exist_ok=True)
        if (old := leftover_pipes(self.logs)) is not None:
            log.warning("quitting the MPS daemon an earlier launcher of this run left", pipes=str(old))
            self._quit(old)
        done = subprocess.run(
            [self.control, "-d"], env={**os.environ, **self.env}, capture_output=True, text=True, timeout=30
        )
        self.running = done.returncode == 0
        if self.running:
            (self.logs / PIPES_RECORD).write_text(f"{self.pipes}\n")
        else:
            log.warning(
                "the MPS daemon did not start; the GPU time-slices", rc=done.returncode, out=done.stderr
            )
            shutil.rmtree(self.pipes, ignore_errors=True)
        return self.running

    def stop(self) -> None:
        """Quit it: its server ends once the services (its clients) have."""
        if not self.running:
            return
        self._quit(self.pipes)
        self.running = False
        (self.logs / PIPES_RECORD).unlink(missing_ok=True)

    def _quit(self, pipes: Path) -> None:
        env = {**os.environ, **self._env(pipes)}
        subprocess.run([self.control], input="quit\n", env=env, capture_output=True, text=True, timeout=30)
        shutil.rmtree(pipes, ignore_errors=True)


def leftover_pipes(logs: Path) -> Path | None:
    """The pipe folder of a daemon a launcher of this run started and did not quit (its record is still in
    the run's `logs/mps`, and its control socket still exists), or None."""
    record = logs / PIPES_RECORD
    if not record.exists():
        return None
    pipes = Path(record.read_text().strip())
    return pipes if (pipes / "control").exists() else None


def missing_control_problem(setting: GpuSharing, control: str | None) -> str | None:
    """run.gpu_sharing=mps without the control binary: the line `rlbus up` refuses with (None when fine)."""
    if setting == "mps" and control is None:
        return f"run.gpu_sharing=mps, but {MPS_CONTROL} is not installed (NVIDIA's driver utilities)"
    return None


def find_control() -> str | None:
    return shutil.which(MPS_CONTROL)


def shares_a_gpu(cfg: RlbusConfig, gpus: int) -> bool:
    """Whether `rlbus up` puts the learner and a rollout replica on one GPU: every GPU replica does when
    the learner is one process (the replicas take cuda:0, its GPU), and with a torchrun learner when it
    leaves no GPU free (`launcher.rollout_gpu`)."""
    if gpus == 0 or cfg.trainer.device == "cpu" or cfg.rollout.device == "cpu" or cfg.rollout.replicas == 0:
        return False
    return cfg.trainer.n_gpus_per_node <= 1 or gpus - cfg.trainer.n_gpus_per_node <= 0


SM_SHARE_ENV = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"  # read by an MPS client when its CUDA context is made
SM_PERCENT_KEYS = {"learner": "mps_learner_sm_percent", "rollout": "mps_rollout_sm_percent"}  # run.<key>


def sm_share_env(cfg: RlbusConfig, service: str) -> dict[str, str]:
    """The SM share a service's process may take under the run's MPS daemon (`run.mps_*_sm_percent`): the
    training kernels fill every SM they are given, so a decode beside them waits unless the learner is capped."""
    key = SM_PERCENT_KEYS.get(service)
    percent = getattr(cfg.run, key) if key is not None else 100
    return {SM_SHARE_ENV: str(percent)} if percent < 100 else {}


def capped_keys(cfg: RlbusConfig) -> list[str]:
    """The `run.mps_*_sm_percent` keys set below 100 (they cap a service only under an MPS daemon)."""
    return [f"run.{key}" for key in SM_PERCENT_KEYS.values() if getattr(cfg.run, key) < 100]


@dataclass(frozen=True)
class RunMps:
    """What the run's services find of MPS: the run's own daemon, or one of the user's (CUDA_MPS_PIPE_DIRECTORY
    set in the launcher's environment, which the services inherit), or neither."""

    daemon: MpsDaemon | None
    outside_daemon: bool

    def service_env(self, cfg: RlbusConfig, service: str) -> dict[str, str]:
        """What a service's environment gains: the run's daemon's folders, and its SM cap under either
        daemon (the user's own honours CUDA_MPS_ACTIVE_THREAD_PERCENTAGE as the run's does)."""
        if self.daemon is None and not self.outside_daemon:
            return {}
        return {**(self.daemon.env if self.daemon is not None else {}), **sm_share_env(cfg, service)}

    def stop(self) -> None:
        if self.daemon is not None:
            self.daemon.stop()


def start_for_run(cfg: RlbusConfig, gpus: int, run_dir: Path) -> RunMps:
    """The run's own MPS daemon, started, when `mps_plan` says so (none otherwise, or when it would not
    start); the reason goes to the launcher's log either way, and a cap that then caps nothing is warned
    about by its key (under time_slice the config's warnings already say so)."""
    control = find_control()
    outside = "CUDA_MPS_PIPE_DIRECTORY" in os.environ
    plan = mps_plan(cfg.run.gpu_sharing, shares_a_gpu(cfg, gpus), control, outside)
    log.info("GPU sharing", mps=plan.start, reason=plan.reason)
    daemon = MpsDaemon(run_dir, control) if plan.start and control is not None else None
    if daemon is not None and not daemon.start():
        daemon = None
    if daemon is None and not outside and cfg.run.gpu_sharing != "time_slice":
        for key in capped_keys(cfg):
            log.warning(f"{key} has no effect: the services do not run under MPS", reason=plan.reason)
    return RunMps(daemon, outside)
