"""Where each rank's share of a checkpoint lives: one folder every rank sees, or a folder per rank.

On a filesystem every learner rank shares (one host, or a ReadWriteMany volume), a checkpoint is written
collectively: one DCP folder with a shard per rank and rank 0's metadata, sealed once by rank 0. Where
each rank has a filesystem of its own (a pod per node with its own volume), rank 1 would never see rank 0's
metadata or marker, so each rank writes a checkpoint complete in itself: its own shard as a single-process
DCP save (`no_dist`: its own metadata), its own meta.json and its own marker ("per_rank" layout). A resume
then needs the same world size and sharding, and a step every rank completed (`common_step`).
Both decisions are collective: every rank calls them together.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import torch.distributed as dist

COLLECTIVE, PER_RANK = "collective", "per_rank"


def _dist_on() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def checkpoint_layout(folder: Path) -> str:
    """COLLECTIVE when every rank sees the files rank 0 writes in `folder`, else PER_RANK (collective call)."""
    if not _dist_on():
        return COLLECTIVE
    probe = [f".rank0-probe-{uuid.uuid4().hex}" if dist.get_rank() == 0 else ""]
    if dist.get_rank() == 0:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / probe[0]).touch()
    dist.broadcast_object_list(probe, src=0)
    folder.mkdir(parents=True, exist_ok=True)
    seen: list[bool] = [False] * dist.get_world_size()
    dist.all_gather_object(seen, (folder / probe[0]).exists())
    if dist.get_rank() == 0:
        (folder / probe[0]).unlink(missing_ok=True)
    return COLLECTIVE if all(seen) else PER_RANK


def common_step(steps_here: list[int]) -> int | None:
    """The newest of `steps_here` that every rank also has (collective call), or None."""
    if not _dist_on():
        return max(steps_here, default=None)
    everyone: list[list[int]] = [[] for _ in range(dist.get_world_size())]
    dist.all_gather_object(everyone, sorted(steps_here))
    common = set(everyone[0]).intersection(*everyone[1:])
    return max(common) if common else None
