"""The memory checkpoint's storage (rlbus.learner.memory_checkpoint): where each tensor lies in a slot, the slot
files in tmpfs, and the copy of a GPU's tensors into one in few large transfers.

A copy per tensor cost ~50 us of host time each (1,450 tensors at the 0.5B shape with its optimizer: 70 ms a
step, measured on an H100), so the tensors are first packed on the GPU, a chunk at a time, with one fused
multi-tensor copy per dtype, and each chunk goes to the host in one transfer.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path

import torch

ALIGN = 64  # bytes: each tensor's offset in a slot, so every dtype can view its bytes
PAGE = 2 << 20  # a slot's size is a multiple of this (cudaHostRegister pins whole pages)
CHUNK = 256 << 20  # bytes packed on the GPU per transfer (one buffer of this size on the GPU)
FREE_AFTER = 0.10  # share of the tmpfs left free (NCCL and data loaders use /dev/shm too)


@dataclass(frozen=True)
class Entry:
    """Where one tensor of the state lies in a slot."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def plan_layout(leaves: list[tuple[str, object]]) -> tuple[list[Entry], int]:
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
    return entries, max(PAGE, (offset + PAGE - 1) // PAGE * PAGE)


def plan_chunks(entries: list[Entry], chunk: int = CHUNK) -> list[list[int]]:
    """Consecutive entries grouped so that each group spans at most `chunk` bytes of a slot (an entry larger
    than that is a group of its own, copied straight to the host)."""
    groups: list[list[int]] = []
    for i, entry in enumerate(entries):
        if groups:
            first = entries[groups[-1][0]]
            if first.nbytes <= chunk and entry.offset + entry.nbytes - first.offset <= chunk:
                groups[-1].append(i)
                continue
        groups.append([i])
    return groups


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


def view_of(raw: torch.Tensor, entry: Entry, base: int = 0) -> torch.Tensor:
    """`entry`'s tensor in the bytes `raw` (which start at slot offset `base`)."""
    start = entry.offset - base
    return raw[start : start + entry.nbytes].view(getattr(torch, entry.dtype)).view(entry.shape)


def clear_cuda_error() -> None:
    """A failed CUDA runtime call leaves its error to be reported by the next kernel launch: take it now."""
    with contextlib.suppress(RuntimeError):
        torch.zeros(1, device="cuda").add_(1)


class Slot:
    """One file in tmpfs, mapped as bytes and carved into a view per tensor (pinned for a GPU's copies); or,
    with no path, the same in this process's memory (the rolling disk checkpoint's copy of a step)."""

    def __init__(self, path: Path | None, size: int, entries: list[Entry], pin: bool) -> None:
        self.path = path
        self.registered = False  # pinned by cudaHostRegister (a mapped file), undone at close
        if path is None:
            self.bytes = torch.empty(size, dtype=torch.uint8, pin_memory=pin)
            self.pinned = pin
        else:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                os.posix_fallocate(fd, 0, size)  # ENOSPC here, not SIGBUS on a page fault mid-copy
            finally:
                os.close(fd)
            self.bytes = torch.from_file(str(path), shared=True, size=size, dtype=torch.uint8)
            self.pinned = False
            if pin:
                err = torch.cuda.cudart().cudaHostRegister(self.bytes.data_ptr(), size, 0)
                self.pinned = self.registered = int(err) == 0
                if not self.pinned:
                    clear_cuda_error()
        self.views = {e.key: view_of(self.bytes, e) for e in entries}

    def close(self) -> None:
        if self.registered:
            torch.cuda.cudart().cudaHostUnregister(self.bytes.data_ptr())
            self.registered = False


class PackedCopy:
    """Copies a fixed list of GPU tensors into a slot: per chunk, the tensors packed into a GPU buffer (a fused
    copy per dtype), then one transfer to the slot's matching bytes. Runs on the current stream."""

    def __init__(
        self, entries: list[Entry], tensors: list[torch.Tensor], device: torch.device, chunk: int = CHUNK
    ) -> None:
        self.entries, self.tensors = entries, tensors
        self.groups = plan_chunks(entries, chunk)
        packed = [g for g in self.groups if entries[g[0]].nbytes <= chunk]
        self.buffer = torch.empty(chunk if packed else 0, dtype=torch.uint8, device=device)
        self.packs: list[
            tuple[int, int, dict[torch.dtype, tuple[list[torch.Tensor], list[torch.Tensor]]]]
        ] = []
        for group in self.groups:
            first, last = entries[group[0]], entries[group[-1]]
            span = last.offset + last.nbytes - first.offset
            by_dtype: dict[torch.dtype, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
            if first.nbytes <= chunk:
                for i in group:
                    dst, src = by_dtype.setdefault(tensors[i].dtype, ([], []))
                    dst.append(view_of(self.buffer, entries[i], first.offset))
                    src.append(tensors[i].detach())
            self.packs.append((first.offset, span, by_dtype))

    def copy_into(self, slot: Slot) -> None:
        for (start, span, by_dtype), group in zip(self.packs, self.groups, strict=True):
            if not by_dtype:  # one tensor larger than the buffer: straight to the host
                entry = self.entries[group[0]]
                slot.views[entry.key].copy_(self.tensors[group[0]].detach(), non_blocking=True)
                continue
            for dst, src in by_dtype.values():
                torch._foreach_copy_(dst, src)
            slot.bytes[start : start + span].copy_(self.buffer[:span], non_blocking=True)
