"""Ranks > 0 of a torchrun learner: follow rank 0's ops (services/learner/dist/context.py) until STOP.

The only module of the learner that imports the trainer, checkpoints and export together: the ops a
worker runs are theirs, and keeping them here keeps `dist.context` free of import cycles.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from rlbus.config import RlbusConfig
from rlbus.learner import checkpoint
from rlbus.learner.dist import context as dist_context
from rlbus.learner.batch import TrainBatch
from rlbus.learner.export import save_hf
from rlbus.learner.trainer import PolicyTrainer


def _recv_batch(meta: dict) -> TrainBatch:
    kwargs: dict[str, Any] = dict(meta["values"])
    for name, dtype, shape in meta["tensors"]:
        t = torch.empty(shape, dtype=getattr(torch, dtype))
        dist.broadcast(t, src=0)
        kwargs[name] = t
    return TrainBatch(**kwargs)


def _save_checkpoint(trainer: PolicyTrainer, path: str, keep: int = 0) -> None:
    """This rank's part of a save; in a folder of its own (per-rank layout) it also prunes that folder,
    keeping what rank 0 keeps (the newest `keep`)."""
    saved = checkpoint.save_checkpoint(Path(path), trainer)
    if keep and checkpoint.is_per_rank(saved):
        checkpoint.prune_checkpoints(saved.parent, keep, own_folder=True)


def _builtin_op(name: str) -> Callable[..., Any] | None:
    """The learner loop's collective calls (rank 0 leads them in service.py; every rank runs the function)."""
    if name == "save_checkpoint":
        return _save_checkpoint
    if name == "load_checkpoint":
        return lambda trainer, path: checkpoint.load_checkpoint(Path(path), trainer)
    if name == "common_checkpoint":  # which step to resume: one every rank completed
        return lambda trainer, root: checkpoint.common_checkpoint(Path(root))
    if name == "save_hf":
        return lambda trainer, path: save_hf(trainer.model, None, Path(path))  # rank 0 writes the files
    return None


def worker_main(cfg: RlbusConfig) -> int:
    """Ranks > 0: follow rank 0's ops until STOP. Returns the exit code."""
    ctx = dist_context.context()
    torch.manual_seed(cfg.trainer.seed)
    trainer = None
    while True:
        op, payload = ctx._recv_op()
        if op == dist_context.OP_STOP:
            ctx.exit_together()
            return 0
        if op == dist_context.OP_INIT:
            assert payload is not None
            trainer = PolicyTrainer(cfg, Path(payload["model_path"]), ctx.device, payload["total_steps"])
            continue
        if trainer is None:
            raise RuntimeError(f"rank {ctx.rank}: {dist_context.OP_NAMES[op]} before INIT")
        if op == dist_context.OP_TRAIN:
            assert payload is not None
            trainer.train_step(_recv_batch(payload))
        elif op == dist_context.OP_GATHER:
            for _ in trainer.named_weights():
                pass
        elif op == dist_context.OP_CALL:
            assert payload is not None
            fn = dist_context.WORKER_OPS.get(payload["name"]) or _builtin_op(payload["name"])
            if fn is None:
                raise RuntimeError(f"rank {ctx.rank}: no worker op {payload['name']!r} is registered")
            fn(trainer, **payload["kwargs"])
