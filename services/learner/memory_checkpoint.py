"""A checkpoint of every step in shared memory (tmpfs: /dev/shm), so a learner process that crashes or is
killed resumes from its last step or the one before, not from its last disk checkpoint.

Why not disk: model and optimizer state at the 0.5B shape is 7.2 GB; a step is 0.36 s on an H100, so a disk
checkpoint per step would need 20 GB/s, and staging it on the training thread cost half a step. Here the
state is copied from the GPU straight into one of two slots of a tmpfs file, pinned so that the copy runs on
the copy engine, on a side stream while the next step's forward and backward run. Only the next optimizer
step waits for it (an optimizer pre-hook: the copy must read the weights before they change). A slot is
named the resumable one (`latest.json`, replaced atomically) only once its copy has landed, so a kill in the
middle of a copy leaves the other slot whole.

The memory outlives the process, not the machine, the container's removal or the pod: the disk checkpoints
(save_freq's, and the rolling one within its budget) cover those. One learner process only (FSDP2 ranks
save collectively at save_freq).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.utils._pytree import keystr, tree_flatten_with_path, tree_unflatten

from rlbus.learner.checkpoint import CheckpointError, checkpoint_meta, restore_trainer_state
from rlbus.learner.rng_state import rng_state

MARKER = "latest.json"  # names the slot that holds a whole step
LAYOUT = "layout.json"  # where each tensor lies in a slot (written once per process, with the slots)
TOKEN_FILE = "memory_checkpoint.json"  # in the run dir: which memory checkpoint belongs to this run's history
ALIGN = 64  # bytes: each tensor's offset in a slot, so every dtype can view its bytes
FREE_AFTER = 0.10  # share of the tmpfs left free (NCCL and data loaders use /dev/shm too)
FORMAT = 1


def default_directory(root: Path, run_dir: Path, run_id: str) -> Path:
    """Where a run's slots live: one folder per run directory (two runs may share a run id)."""
    digest = hashlib.sha1(str(run_dir.resolve()).encode()).hexdigest()[:8]
    safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in run_id)[:40]
    return root / f"rlbus-{safe}-{digest}"


def state_tree(trainer: Any) -> dict[str, Any]:
    """Model and optimizer state (and the critic's), as the disk checkpoint holds them."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(trainer.model, trainer.optimizer)
    tree: dict[str, Any] = {"model": model_sd, "optim": optim_sd}
    critic = getattr(trainer, "critic", None)
    if critic is not None:
        c_model, c_optim = get_state_dict(critic.model, critic.optimizer)
        tree["critic"] = {"model": c_model, "optim": c_optim}
    return tree


@dataclass(frozen=True)
class Entry:
    """Where one tensor of the state lies in a slot."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def plan_layout(leaves: list[tuple[str, Any]]) -> tuple[list[Entry], int]:
    """Each tensor leaf at an aligned offset; returns the entries and a slot's size in bytes."""
    entries: list[Entry] = []
    offset = 0
    for key, value in leaves:
        if not isinstance(value, torch.Tensor):
            continue
        nbytes = value.numel() * value.element_size()
        entries.append(
            Entry(key, str(value.dtype).removeprefix("torch."), tuple(value.shape), offset, nbytes)
        )
        offset += (nbytes + ALIGN - 1) // ALIGN * ALIGN
    return entries, max(offset, ALIGN)


def tmpfs_room(directory: Path, wanted: int) -> str | None:
    """Why `wanted` bytes do not fit in `directory`'s filesystem, leaving FREE_AFTER of it free; None if they do."""
    probe = directory
    while not probe.exists():
        probe = probe.parent
    st = os.statvfs(probe)
    free, total = st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize
    if wanted > free - FREE_AFTER * total:
        return f"needs {wanted / 1e9:.2f} GB in {probe}, which has {free / 1e9:.2f} GB free of {total / 1e9:.2f} GB"
    return None


class Slot:
    """One file in tmpfs, mapped as bytes and carved into a view per tensor (pinned for a GPU's copies)."""

    def __init__(self, path: Path, size: int, entries: list[Entry], pin: bool) -> None:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            os.posix_fallocate(fd, 0, size)  # ENOSPC here, not SIGBUS on a page fault mid-copy
        finally:
            os.close(fd)
        self.path = path
        self.bytes = torch.from_file(str(path), shared=True, size=size, dtype=torch.uint8)
        self.pinned = False
        if pin:
            err = torch.cuda.cudart().cudaHostRegister(self.bytes.data_ptr(), size, 0)
            self.pinned = int(err) == 0
        self.views = {e.key: self._view(e) for e in entries}

    def _view(self, entry: Entry) -> torch.Tensor:
        raw = self.bytes[entry.offset : entry.offset + entry.nbytes]
        return raw.view(getattr(torch, entry.dtype)).view(entry.shape)

    def close(self) -> None:
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.bytes.data_ptr())
            self.pinned = False


@dataclass
class Pending:
    """A step whose copy was started and has not been named resumable yet."""

    step: int
    slot: int
    record: dict[str, Any] = field(default_factory=dict)  # latest.json's content once it lands
    done: torch.cuda.Event | None = None


class MemoryCheckpointer:
    """After each step, copies the state into the slot not named in latest.json; names it there once the copy
    has landed (at the next step, whose optimizer step waited for it)."""

    def __init__(self, directory: Path, trainer: Any, run_dir: Path, log: Any) -> None:
        self.directory, self.trainer, self.run_dir, self.log = directory, trainer, run_dir, log
        self.entries: list[Entry] | None = None
        self.slots: list[Slot] = []
        self.committed_slot = committed_slot(directory)  # never overwritten until another slot is named
        self.layout_id = ""
        self.pending: Pending | None = None
        self.off_reason: str | None = None
        self.paid_s = 0.0  # host seconds the steps spent here, for metrics
        self.saved = 0
        on_gpu = next(trainer.model.parameters()).is_cuda
        self.stream = torch.cuda.Stream() if on_gpu else None
        optimizers = [trainer.optimizer]
        critic = getattr(trainer, "critic", None)
        if critic is not None:
            optimizers.append(critic.optimizer)
        self._hooks = [opt.register_step_pre_hook(self._before_optimizer_step) for opt in optimizers]

    def _before_optimizer_step(self, *_: Any) -> None:
        """The weights change next: the copy in flight must have read them first (a wait on the GPU)."""
        if self.pending is not None and self.pending.done is not None:
            torch.cuda.current_stream().wait_event(self.pending.done)

    def _allocate(self, leaves: list[tuple[str, Any]]) -> bool:
        entries, size = plan_layout(leaves)
        self.directory.mkdir(parents=True, exist_ok=True)
        reason = tmpfs_room(self.directory, 2 * size - sum(s.stat().st_size for s in self._slot_files()))
        if reason is None:
            try:
                self.slots = [
                    Slot(self.directory / f"slot{i}.bin", size, entries, self.stream is not None)
                    for i in range(2)
                ]
            except OSError as exc:
                reason = f"{type(exc).__name__}: {exc}"
        if reason is not None:
            self.off_reason = reason
            self.log.warning("memory checkpoint off: the state does not fit", detail=reason)
            return False
        self.entries = entries
        layout = json.dumps([e.__dict__ for e in entries])
        self.layout_id = hashlib.sha1(layout.encode()).hexdigest()[:16]
        (self.directory / LAYOUT).write_text(layout)
        if self.stream is not None and not all(s.pinned for s in self.slots):
            self.log.warning("memory checkpoint: slots not pinned, copies run at pageable speed")
        return True

    def _slot_files(self) -> list[Path]:
        return [p for p in (self.directory / f"slot{i}.bin" for i in range(2)) if p.exists()]

    def after_step(self, step: int, extra: Callable[[], dict[str, Any]]) -> float:
        """Names the previous step's slot resumable and starts copying `step` into the other; returns the
        host seconds this took (the copy itself overlaps the next step)."""
        if self.off_reason is not None:
            return 0.0
        t0 = time.perf_counter()
        self._commit()
        leaves_with_path, _ = tree_flatten_with_path(state_tree(self.trainer))
        leaves = [(keystr(path), value) for path, value in leaves_with_path]
        if self.entries is None and not self._allocate(leaves):
            return 0.0
        slot_index = 1 - self.committed_slot
        views = self.slots[slot_index].views
        done = None
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream())  # the step's last writes are in
            with torch.cuda.stream(self.stream):
                for key, value in leaves:
                    if isinstance(value, torch.Tensor):
                        views[key].copy_(value.detach(), non_blocking=True)
                done = torch.cuda.Event()
                done.record(self.stream)
        else:
            for key, value in leaves:
                if isinstance(value, torch.Tensor):
                    views[key].copy_(value.detach())
        record = {
            "format": FORMAT,
            "step": step,
            "slot": slot_index,
            "layout": self.layout_id,
            "scalars": [[k, v] for k, v in leaves if not isinstance(v, torch.Tensor)],
            "meta": checkpoint_meta(self.trainer, extra()),
            "rng": rng_state(),
            "token": run_token(self.run_dir),
        }
        self.pending = Pending(step, slot_index, record, done)
        if done is None:
            self._commit()  # a CPU copy has landed already
        paid = time.perf_counter() - t0
        self.paid_s += paid
        return paid

    def _commit(self) -> None:
        pending, self.pending = self.pending, None
        if pending is None:
            return
        if pending.done is not None:
            pending.done.synchronize()  # landed long ago, normally: the optimizer step waited for it
        tmp = self.directory / (MARKER + ".tmp")
        tmp.write_text(json.dumps(pending.record))
        tmp.replace(self.directory / MARKER)
        self.committed_slot = pending.slot
        self.saved += 1

    def flush(self) -> None:
        """The copy in flight named resumable (at the end of a run, before the slots are removed)."""
        self._commit()

    def close(self, remove: bool) -> None:
        """Unpins the slots; `remove` deletes them (the run finished: nothing left to resume)."""
        for hook in self._hooks:
            hook.remove()
        self._commit()
        for slot in self.slots:
            slot.close()
        self.slots = []
        if remove:
            shutil.rmtree(self.directory, ignore_errors=True)


# ------------------------------------------------------------------------------------------ resume


def committed_slot(directory: Path) -> int:
    """The slot latest.json names (a resumed process's first copy must go to the other); 1 when none."""
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        return int(json.loads((directory / MARKER).read_text())["slot"])
    return 1


def run_token(run_dir: Path) -> str:
    """This run directory's memory-checkpoint token (made once): slots whose token differs belong to another
    history of the run id (its run dir was removed since), and are never resumed."""
    path = run_dir / TOKEN_FILE
    with contextlib.suppress(OSError, ValueError):
        return str(json.loads(path.read_text())["token"])
    token = os.urandom(8).hex()
    run_dir.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"token": token, "made_at": time.time()}))
    return token


@dataclass(frozen=True)
class MemoryCheckpoint:
    """A resumable step found in shared memory."""

    directory: Path
    step: int
    record: dict[str, Any]

    def __str__(self) -> str:
        return f"{self.directory} (memory, step {self.step})"


def find_memory_checkpoint(directory: Path, run_dir: Path) -> MemoryCheckpoint | None:
    """The step latest.json names, if it belongs to this run dir's history."""
    path = directory / MARKER
    if not (run_dir / TOKEN_FILE).is_file() or not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
    except ValueError:
        return None
    if record.get("format") != FORMAT or record.get("token") != run_token(run_dir):
        return None
    return MemoryCheckpoint(directory, int(record["step"]), record)


def load_memory_checkpoint(checkpoint: MemoryCheckpoint, trainer: Any) -> dict[str, Any]:
    """The slot's tensors and latest.json's scalars into `trainer`'s state; returns the saved `extra`."""
    from torch.distributed.checkpoint.state_dict import set_state_dict

    record = checkpoint.record
    layout = (checkpoint.directory / LAYOUT).read_text()
    if hashlib.sha1(layout.encode()).hexdigest()[:16] != record.get("layout"):
        raise CheckpointError(f"{checkpoint}: its layout file is not the one its step was copied with")
    entries = [
        Entry(e["key"], e["dtype"], tuple(e["shape"]), e["offset"], e["nbytes"]) for e in json.loads(layout)
    ]
    size = max((e.offset + e.nbytes for e in entries), default=ALIGN)
    slot_path = checkpoint.directory / f"slot{record['slot']}.bin"
    if not slot_path.is_file() or slot_path.stat().st_size < size:
        raise CheckpointError(f"{checkpoint}: its slot file is missing or short")
    raw = torch.from_file(str(slot_path), shared=False, size=slot_path.stat().st_size, dtype=torch.uint8)
    by_key = {e.key: e for e in entries}
    scalars = {k: v for k, v in record["scalars"]}
    leaves_with_path, spec = tree_flatten_with_path(state_tree(trainer))
    values: list[Any] = []
    for path, value in leaves_with_path:
        key = keystr(path)
        if isinstance(value, torch.Tensor):
            entry = by_key.get(key)
            if entry is None or tuple(value.shape) != entry.shape:
                raise CheckpointError(f"{checkpoint}: {key} does not fit this trainer")
            saved = raw[entry.offset : entry.offset + entry.nbytes].view(getattr(torch, entry.dtype))
            value.detach().copy_(saved.view(entry.shape))
            values.append(value)
        else:
            values.append(scalars.get(key, value))
    state = tree_unflatten(values, spec)
    set_state_dict(
        trainer.model, trainer.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    critic = getattr(trainer, "critic", None)
    if critic is not None:
        set_state_dict(
            critic.model,
            critic.optimizer,
            model_state_dict=state["critic"]["model"],
            optim_state_dict=state["critic"]["optim"],
        )
    meta = record["meta"]
    restore_trainer_state(trainer, meta.get("trainer", {}), record.get("rng"))
    return dict(meta.get("extra", {}))
