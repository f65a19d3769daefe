"""What the learner saves after each step besides save_freq's kept checkpoints, and which saved step a new
learner process resumes: the memory checkpoint (every step, rlbus.learner.memory_checkpoint) and the rolling
disk checkpoint (within its budget, rlbus.learner.rolling_checkpoint)."""

from __future__ import annotations

import functools
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rlbus.config import RlbusConfig
from rlbus.learner.checkpoint import checkpoint_root, checkpoint_step
from rlbus.learner.memory_checkpoint import (
    MemoryCheckpoint,
    MemoryCheckpointer,
    default_directory,
    find_memory_checkpoint,
)
from rlbus.learner.rolling_checkpoint import RollingCheckpointer, Staged


def memory_wanted(mode: str, on_gpu: bool, world: int) -> bool:
    """trainer.memory_checkpoint: auto = one learner process on a GPU (on a CPU a step's state is small and
    the rolling disk checkpoint stages every step already)."""
    return world == 1 and (mode == "on" or (mode == "auto" and on_gpu))


def newest(disk: Path | None, memory: MemoryCheckpoint | None) -> Path | MemoryCheckpoint | None:
    """The later of the disk checkpoint and the memory one (disk on a tie: it survives more)."""
    if memory is None or (disk is not None and checkpoint_step(disk) >= memory.step):
        return disk
    return memory


def memory_directory(cfg: RlbusConfig, run_dir: Path) -> Path:
    return default_directory(cfg.trainer.memory_checkpoint_dir, run_dir, cfg.run.id)


def resume_source(cfg: RlbusConfig, run_dir: Path, disk: Path | None) -> Path | MemoryCheckpoint | None:
    """What a learner start resumes: `disk` (resume_target's pick), or a newer memory checkpoint of this run
    under resume_mode=auto. A start that does not resume the memory one removes this run dir's slots: they
    hold another lineage's steps (a later start must never prefer them to this one's disk checkpoints)."""
    memory = None
    single = int(os.environ.get("WORLD_SIZE", "1")) == 1
    if cfg.trainer.resume_mode == "auto" and cfg.trainer.memory_checkpoint != "off" and single:
        memory = find_memory_checkpoint(memory_directory(cfg, run_dir), run_dir)
    source = newest(disk, memory)
    if not isinstance(source, MemoryCheckpoint):
        shutil.rmtree(memory_directory(cfg, run_dir), ignore_errors=True)
    return source


def other_runs_slots(root: Path, own: Path) -> dict[Path, int]:
    """Memory checkpoints of other runs in `root` and their bytes: a run stopped and never resumed (or
    finished elsewhere) leaves its slots in memory until someone removes them."""
    found: dict[Path, int] = {}
    for folder in root.glob("rlbus-*"):
        if folder != own and folder.is_dir():
            found[folder] = sum(f.stat().st_size for f in folder.iterdir() if f.is_file())
    return found


class StepCheckpoints:
    """The memory and rolling checkpoints of one learner process: called after every step."""

    def __init__(
        self, cfg: RlbusConfig, run_dir: Path, trainer: Any, is_kept: Callable[[int], bool], log: Any
    ):
        tcfg = cfg.trainer
        single = trainer.par.world_size == 1
        on_gpu = next(trainer.model.parameters()).is_cuda
        self.memory = (
            MemoryCheckpointer(memory_directory(cfg, run_dir), trainer, run_dir, log)
            if memory_wanted(tcfg.memory_checkpoint, on_gpu, trainer.par.world_size)
            else None
        )
        if self.memory is not None and (
            others := other_runs_slots(tcfg.memory_checkpoint_dir, self.memory.directory)
        ):
            log.warning(
                "memory checkpoints of other runs hold shared memory: remove those whose runs are over",
                folders=[str(p) for p in sorted(others)],
                gb=round(sum(others.values()) / 1e9, 2),
            )
        self.rolling = (
            RollingCheckpointer(
                checkpoint_root(run_dir, tcfg.default_local_dir),
                tcfg.rolling_checkpoint_budget,
                tcfg.max_ckpt_to_keep,
                is_kept,
                log,
            )
            if tcfg.rolling_checkpoint_budget > 0 and single
            else None
        )

    @property
    def staged_total_s(self) -> float:
        """Seconds the steps paid staging rolling checkpoints (for metrics)."""
        return self.rolling.staged_total_s if self.rolling else 0.0

    @property
    def memory_paid_s(self) -> float:
        """Host seconds the steps paid the memory checkpoint (for metrics; its copies overlap the steps)."""
        return self.memory.paid_s if self.memory else 0.0

    async def after_step(
        self,
        done: int,
        step_s: float,
        trainer: Any,
        extra: Callable[[], dict[str, Any]],
        tokenizer: Any,
        kept: bool,
    ) -> None:
        """`done` steps trained; `kept`: save_freq's checkpoint of it was just written (no rolling one then).
        `extra` (the run's position and ledger, which grows with the run) is built once for both."""
        once = functools.cache(extra)
        if self.memory is not None:
            self.memory.after_step(done, once)
        if self.rolling is not None and not kept:
            await self.rolling.after_step(
                done,
                step_s,
                trainer,
                once,
                tokenizer,
                lambda path: self._staged_from_memory(path, done, trainer, tokenizer),
            )

    def _staged_from_memory(self, path: Path, done: int, trainer: Any, tokenizer: Any) -> Staged | None:
        """The rolling checkpoint's staging from the memory checkpoint's copy of the step: on a GPU a second
        copy on the memory checkpoint's side stream, where staging on the step's thread cost 42-49% of a step
        at the 0.5B shape (bench/checkpoint.py); None where the memory checkpoint cannot give it."""
        staging = self.memory.stage_for_disk(done) if self.memory is not None else None
        if staging is None:
            return None
        state = staging.state
        meta, rng = staging.record["meta"], staging.record["rng"]
        critic = state.get("critic")
        policy = {"model": state["model"], "optim": state["optim"]}
        return Staged(
            path, policy, critic, meta, rng, trainer.model, tokenizer, time.perf_counter(), staging.ready
        )

    async def flush(self) -> None:
        """Before a kept save: no rolling write beside it (nor beside its prune)."""
        if self.rolling is not None:
            await self.rolling.flush()

    async def finish(self) -> None:
        """The run is over: the rolling write awaited, the memory slots removed (nothing left to resume)."""
        await self.flush()
        if self.memory is not None:
            self.memory.close(remove=True)
