"""A rolling checkpoint of the newest step, so a learner restart retrains at most a step or so, not up to
`trainer.save_freq - 1` steps (each restart did: 4 learner kills in a fault run cost up to 36 steps).

The step pays for staging: model and optimizer state copied to host memory (with the memory checkpoint on, a
GPU's default, the memory checkpointer makes that copy on its side stream instead: `stager`). Writing them
(DCP files, the JSON, the HF files, the COMPLETE marker, the rename) runs in a thread while the next steps
train, and slows them a little (the writer threads share the host). How often a step stages is a pure decision
(`rolling_due`): when the last checkpoint's whole cost (its staging plus what the steps during its write took
beyond a step without one), spread over the steps since, is within `trainer.rolling_checkpoint_budget` of a
step's time (on an H100 at the 0.5B shape, staging alone was 3.5% of the steps and the write's slowdown
another 1.7%). The tiny demo stages every step; a model whose staging costs 20% of a step stages every 4th.
One process only: FSDP2 ranks save collectively at save_freq (a background collective would race the training
step's).
"""

from __future__ import annotations

import asyncio
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils._pytree import tree_flatten_with_path, tree_unflatten

from rlbus.learner.checkpoint import (
    _single_process_quiet,
    checkpoint_meta,
    prune_checkpoints,
    seal_checkpoint,
    step_dir,
    write_small_files,
)
from rlbus.learner.rng_state import rng_state

WRITERS = 4  # DCP writer threads of a rolling checkpoint


def rolling_due(steps_since: int, cost_s: float | None, step_s: float, budget: float) -> bool:
    """Whether to stage now: never measured yet, or the last checkpoint's cost spread over `steps_since` steps
    fits the budget."""
    if budget <= 0:
        return False
    if cost_s is None:
        return True
    return cost_s <= budget * max(step_s, 1e-9) * steps_since


@dataclass
class CheckpointCost:
    """What the last rolling checkpoint cost the steps: its staging, plus what the steps during its write took
    beyond a plain step (a moving average of the steps with no write in flight)."""

    stage_s: float | None = None
    plain_step_s: float | None = None
    write_slowdown_s: float = 0.0
    steps_since: int = 0

    def step(self, step_s: float, writing: bool) -> None:
        self.steps_since += 1
        if writing:
            if self.plain_step_s is not None:
                self.write_slowdown_s += max(0.0, step_s - self.plain_step_s)
        else:
            plain = self.plain_step_s
            self.plain_step_s = step_s if plain is None else 0.8 * plain + 0.2 * step_s

    def due(self, budget: float) -> bool:
        cost = None if self.stage_s is None else self.stage_s + self.write_slowdown_s
        return rolling_due(self.steps_since, cost, self.plain_step_s or 0.0, budget)

    def staged(self, stage_s: float) -> None:
        self.stage_s, self.steps_since, self.write_slowdown_s = stage_s, 0, 0.0


class HostBuffers:
    """Host memory the staged tensors are copied into, kept from one rolling checkpoint to the next (pinned
    for a GPU model: the copy runs at the link's speed, not pageable memory's). Safe to reuse: a staging
    waits for the previous write to finish."""

    def __init__(self) -> None:
        self._by_key: dict[tuple[str, ...], torch.Tensor] = {}

    def copy(self, tree: Any) -> Any:
        """`tree` with each tensor replaced by its copy in host memory."""
        leaves, spec = tree_flatten_with_path(tree)
        out = []
        for path, value in leaves:
            if not isinstance(value, torch.Tensor):
                out.append(value)
                continue
            value = value.detach()
            key = tuple(str(k) for k in path)
            buf = self._by_key.get(key)
            if buf is None or buf.shape != value.shape or buf.dtype != value.dtype:
                pin = value.is_cuda and torch.cuda.is_available()
                buf = torch.empty(value.shape, dtype=value.dtype, device="cpu", pin_memory=pin)
                self._by_key[key] = buf
            buf.copy_(value, non_blocking=value.is_cuda)
            out.append(buf)
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # every non-blocking copy has landed before anyone reads the buffers
        return tree_unflatten(out, spec)


@dataclass
class Staged:
    """One step's state in host memory, waiting to be written."""

    path: Path
    state: dict[str, Any]
    critic: dict[str, Any] | None
    meta: dict[str, Any]
    rng: dict[str, Any]
    model: Any  # for its config (HF files)
    tokenizer: Any
    t0: float
    ready: Any = None  # a CUDA event the state's copy ends with (staged on a side stream); None: copied


def stage(
    path: Path, trainer: Any, extra: dict[str, Any], tokenizer: Any, host: HostBuffers | None = None
) -> Staged:
    """The step's model, optimizer (and critic) state copied to host memory, with its metadata."""
    import copy

    from torch.distributed.checkpoint.state_dict import get_state_dict

    t0 = time.perf_counter()
    host = host or HostBuffers()
    model_sd, optim_sd = get_state_dict(trainer.model, trainer.optimizer)
    critic = getattr(trainer, "critic", None)
    critic_state = None
    if critic is not None:
        c_model, c_optim = get_state_dict(critic.model, critic.optimizer)
        state, critic_state = host.copy(
            ({"model": model_sd, "optim": optim_sd}, {"model": c_model, "optim": c_optim})
        )
    else:
        state = host.copy({"model": model_sd, "optim": optim_sd})
    meta = copy.deepcopy(checkpoint_meta(trainer, extra))
    return Staged(path, state, critic_state, meta, rng_state(), trainer.model, tokenizer, t0)


def write(staged: Staged) -> Path:
    """Everything staged onto disk as a complete checkpoint (same layout as save_checkpoint's)."""
    import torch.distributed.checkpoint as dcp

    if staged.ready is not None:
        staged.ready.synchronize()  # the state's copy into host memory has landed
    tmp = staged.path.with_name(staged.path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    with _single_process_quiet():  # several writer threads: one wrote 7 GB at 0.7 GB/s on the H200's box
        dcp.save(staged.state, storage_writer=dcp.FileSystemWriter(str(tmp / "state"), thread_count=WRITERS))
        if staged.critic is not None:
            dcp.save(
                staged.critic, storage_writer=dcp.FileSystemWriter(str(tmp / "critic"), thread_count=WRITERS)
            )
    write_small_files(tmp, staged.meta, staged.rng, staged.model, staged.tokenizer)
    seal_checkpoint(tmp, staged.path, staged.t0)
    return staged.path


class RollingCheckpointer:
    """Stages a rolling checkpoint after a step when it is due and writes it in the background; at most one
    write in flight (a step while one is writing stages nothing); the rolling ones older than the newest are
    removed."""

    def __init__(
        self, root: Path, budget: float, keep: int, is_kept: Callable[[int], bool], log: Any
    ) -> None:
        self.root, self.budget, self.keep, self.is_kept, self.log = root, budget, keep, is_kept, log
        self.cost = CheckpointCost()
        self.staged_total_s = 0.0  # what the steps paid, for metrics
        self.written = 0
        self.host = HostBuffers()
        self._writing: asyncio.Future | None = None
        self._write_done = threading.Event()

    async def after_step(
        self,
        step: int,
        step_s: float,
        trainer: Any,
        extra: Callable[[], dict[str, Any]],
        tokenizer: Any,
        stager: Callable[[Path], Staged | None] | None = None,
    ) -> float:
        """Stage `step` when due and the last write is done (a step never waits for the disk), and start
        writing it; returns the seconds the step paid. `stager` stages it another way when it can (from the
        memory checkpoint's copy); else `stage` copies the state here."""
        # the writer thread's own flag: the future wrapping it completes only once the event loop turns
        writing = self._writing is not None and not self._write_done.is_set()
        self.cost.step(step_s, writing)
        if writing or not self.cost.due(self.budget):
            return 0.0
        await self.flush()  # done already: only collects its outcome
        path = step_dir(self.root, step)
        t0 = time.perf_counter()
        staged = stager(path) if stager is not None else None
        if staged is None:  # the step's own thread: no hop, no race
            staged = stage(path, trainer, extra(), tokenizer, self.host)
        stage_s = time.perf_counter() - t0
        self.cost.staged(stage_s)
        self.staged_total_s += stage_s
        self._write_done.clear()  # submitted now (a task would start the thread only once the loop turns)
        self._writing = asyncio.get_running_loop().run_in_executor(None, self._write_and_prune, staged)
        return stage_s

    def _write_and_prune(self, staged: Staged) -> None:
        try:
            write(staged)
            self.written += 1
            prune_checkpoints(self.root, self.keep, self.is_kept)
        finally:
            self._write_done.set()

    async def flush(self) -> None:
        """Wait for the write in flight (before a kept save, or at the end); a failed write is logged."""
        task, self._writing = self._writing, None
        if task is None:
            return
        try:
            await task
        except Exception as exc:  # noqa: BLE001 - a rolling checkpoint is a convenience: the run goes on
            self.log.warning("rolling checkpoint not written", error=f"{type(exc).__name__}: {exc}")
