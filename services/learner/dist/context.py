"""The rank-0-led op protocol over the default process group: world set-up and teardown, ops, batch broadcast."""

from __future__ import annotations

import inspect
import json
import math
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, fields
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any
import torch
import torch.distributed as dist
from torch import nn
from rlbus.logs import get_logger
if TYPE_CHECKING:
    from rlbus.config import RlbusConfig
    from rlbus.learner.batch import TrainBatch



OP_INIT, OP_TRAIN, OP_GATHER, OP_CALL, OP_STOP = 1, 2, 3, 4, 5
OP_NAMES = {OP_INIT: "INIT", OP_TRAIN: "TRAIN", OP_GATHER: "GATHER", OP_CALL: "CALL", OP_STOP: "STOP"}
_MAGIC = 0x524C4255_534C4541  # "RLBUSLEA"
DEFAULT_TIMEOUT_S = 3600.0

WORKER_OPS: dict[str, Callable[..., Any]] = {}
log = get_logger("rlbus.learner.dist")


def register_worker_op(name: str, fn: Callable[..., Any]) -> None:
    """Make ``fn(trainer, **kwargs)`` runnable on the worker ranks by ``DistContext.lead_call(name, ...)``.

    For work that is a collective under FSDP (a sharded checkpoint save/load with
    ``torch.distributed.checkpoint``): rank 0 calls ``lead_call`` and then does its own part; every worker
    runs ``fn`` with the same kwargs at the same point of the op sequence.
    """
    WORKER_OPS[name] = fn


# ------------------------------------------------------------------------------------------ process group


@dataclass
class DistContext:
    """Who this process is. ``initialized`` means a default process group exists and FSDP2 is used."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    initialized: bool = False
    _active_gather: _LedGather | None = field(default=None, repr=False)
    mid_op: bool = field(default=False, repr=False)  # rank 0 is inside a led op (collectives under way)

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.initialized and self.world_size > 1

    @property
    def leads_workers(self) -> bool:
        return self.distributed and self.rank == 0

    # -------------------------------------------------------------------------------------- wire

    def _send_op(self, op: int, payload: dict | None = None) -> None:
        data = json.dumps(payload).encode() if payload is not None else b""
        header = torch.tensor([_MAGIC, op, len(data), 0], dtype=torch.int64)
        dist.broadcast(header, src=0)
        if data:
            dist.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8), src=0)

    def _recv_op(self) -> tuple[int, dict | None]:
        header = torch.zeros(4, dtype=torch.int64)
        dist.broadcast(header, src=0)
        magic, op, nbytes, _ = (int(x) for x in header.tolist())
        if magic != _MAGIC or op not in OP_NAMES:
            raise RuntimeError(
                f"rank {self.rank}: bad op header {header.tolist()}: the ranks are out of step"
            )
        payload = None
        if nbytes:
            buf = torch.empty(nbytes, dtype=torch.uint8)
            dist.broadcast(buf, src=0)
            payload = json.loads(bytes(buf.numpy()))
        return op, payload

    def _finish_gather(self) -> None:
        gen, self._active_gather = self._active_gather, None
        if gen is not None:
            gen.close()  # a started gather drains; a never-started one sent nothing

    # ---------------------------------------------------------------------------------- leader side

    def lead_init(self, model_path: Path | str, total_steps: int) -> None:
        """Rank 0 builds its trainer: the workers build theirs from the same checkpoint and schedule."""
        if self.leads_workers:
            self._finish_gather()
            self._send_op(OP_INIT, {"model_path": str(model_path), "total_steps": int(total_steps)})

    def lead_train(self, batch: TrainBatch) -> TrainBatch:
        """Rank 0: send the batch to every worker (they then run the same train_step). Identity elsewhere."""
        if not self.leads_workers:
            return batch
        self._finish_gather()
        self.mid_op = True
        tensors, meta = _batch_parts(batch)
        self._send_op(OP_TRAIN, meta)
        for t in tensors:
            dist.broadcast(t, src=0)
        return batch

    def end_op(self) -> None:
        self.mid_op = False

    def lead_gather(self, make_items: Callable[[], Iterable[tuple[str, torch.Tensor]]]) -> Iterator:
        """Rank 0 of several: a lazy stream that tells the workers to gather alongside once it starts.

        Creating it sends nothing (a push that fails before sending never desyncs anyone). A stream left
        unfinished (the sender gave up mid-push) is drained by the next led op, so the ranks stay in step.
        """
        if not self.leads_workers:
            return iter(make_items())
        return _LedGather(self, make_items)

    def lead_call(self, name: str, **kwargs: Any) -> None:
        """Rank 0: run the registered worker op ``name`` on every worker (then do rank 0's own part)."""
        if self.leads_workers:
            self._finish_gather()
            self._send_op(OP_CALL, {"name": name, "kwargs": kwargs})

    def stop_workers(self) -> None:
        """Rank 0: end every worker's loop. Skipped when a led op broke off halfway (the ranks are out of
        step and a header would be read as that op's data): torchrun then tears the group down."""
        if self.leads_workers:
            self._finish_gather()
            if not self.mid_op:
                self._send_op(OP_STOP)
                self.exit_together()

    def exit_together(self) -> None:
        """Every rank waits here before tearing its group down: a rank that destroys gloo's pairs while a
        peer still uses them can abort the peer's process at exit ('terminate called without an active
        exception'), which torchrun reports as a failed job."""
        self.all_reduce(torch.zeros(1))

    # ---------------------------------------------------------------------------------- collectives

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """In place on every rank (identity without a group). ``op``: sum, max, avg (via sum / world)."""
        if not self.distributed:
            return tensor
        if op == "max":
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        else:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
            if op == "avg":
                tensor /= self.world_size
        return tensor

    def max_int(self, value: int) -> int:
        if not self.distributed:
            return int(value)
        return int(self.all_reduce(torch.tensor([int(value)], dtype=torch.int64), "max").item())


class _LedGather:
    """Iterator of ``(name, full tensor)`` on rank 0 whose first ``next()`` starts the workers' gather."""

    def __init__(
        self, ctx: DistContext, make_items: Callable[[], Iterable[tuple[str, torch.Tensor]]]
    ) -> None:
        self.ctx = ctx
        self.make_items = make_items
        self.items: Iterator | None = None
        self.done = False

    def __iter__(self) -> _LedGather:
        return self

    def __next__(self) -> tuple[str, torch.Tensor]:
        if self.done:
            raise StopIteration
        ctx = self.ctx
        if self.items is None:
            ctx._finish_gather()
            ctx.mid_op = True
            ctx._send_op(OP_GATHER)
            ctx._active_gather = self
            self.items = iter(self.make_items())
        try:
            return next(self.items)
        except StopIteration:
            self._end()
            raise
        except BaseException:
            self.done = True  # a collective failed: the ranks are out of step, mid_op stays set
            raise

    def close(self) -> None:
        """Finish the gather without handing anything out (every rank iterates to the end together)."""
        if self.items is not None and not self.done:
            for _ in self.items:
                pass
            self._end()

    def _end(self) -> None:
        self.done = True
        self.ctx.mid_op = False
        if self.ctx._active_gather is self:
            self.ctx._active_gather = None


_CTX: DistContext | None = None


def _env_int(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        return default


def init_distributed(device_pref: str = "auto", timeout_s: float = DEFAULT_TIMEOUT_S) -> DistContext:
    """Set up this process from torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT).

    WORLD_SIZE > 1: ``init_process_group`` (``gloo`` on CPU, ``cpu:gloo,cuda:nccl`` on GPU) with device
    ``cuda:LOCAL_RANK``. One process on a GPU: a world of one (FSDP2 still gives mixed precision with fp32
    master weights and CPU offload). One process on the CPU: no group at all, the plain module.
    Idempotent: later calls return the same context.
    """
    global _CTX
    if _CTX is not None:
        return _CTX
    world = _env_int("WORLD_SIZE", 1)
    rank = _env_int("RANK", 0)
    local_rank = _env_int("LOCAL_RANK", 0)
    use_cuda = torch.cuda.is_available() and device_pref in ("auto", "cuda")
    if use_cuda:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    timeout = timedelta(seconds=timeout_s)
    if dist.is_initialized():
        _CTX = DistContext(dist.get_rank(), dist.get_world_size(), local_rank, device, True)
    elif world > 1:
        dist.init_process_group("cpu:gloo,cuda:nccl" if use_cuda else "gloo", timeout=timeout)
        _CTX = DistContext(rank, world, local_rank, device, True)
    elif use_cuda:
        dist.init_process_group(
            "cpu:gloo,cuda:nccl", store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
        )
        _CTX = DistContext(0, 1, local_rank, device, True)
    else:
        _CTX = DistContext(0, 1, 0, device, False)
    return _CTX


def context(device: torch.device | str | None = None) -> DistContext:
    """The process's context: the one ``init_distributed`` made, else the one a bare trainer needs.

    A trainer built without ``init_distributed`` (tests, notebooks) on a CUDA device or under torchrun
    initialises here; on the CPU it stays a plain single process on ``device``.
    """
    if _CTX is not None:
        return _CTX
    dev = torch.device(device) if device is not None else torch.device("cpu")
    if dist.is_initialized() or _env_int("WORLD_SIZE", 1) > 1 or dev.type == "cuda":
        return init_distributed("cuda" if dev.type == "cuda" else "cpu")
    return DistContext(device=dev)


def shutdown() -> None:
    """Destroy the default group this module made (no-op otherwise)."""
    global _CTX
    ctx, _CTX = _CTX, None
    if ctx is not None and ctx.initialized and dist.is_initialized():
        dist.destroy_process_group()


def _batch_parts(batch: TrainBatch) -> tuple[list[torch.Tensor], dict]:
    """The batch's tensors (CPU, contiguous) and a JSON description: any TrainBatch field travels."""
    tensors, described, values = [], [], {}
    for f in fields(batch):
        v = getattr(batch, f.name)
        if isinstance(v, torch.Tensor):
            t = v.detach().to("cpu").contiguous()
            tensors.append(t)
            described.append([f.name, str(t.dtype).removeprefix("torch."), list(t.shape)])
        else:
            values[f.name] = v
    return tensors, {"tensors": described, "values": values}


def reduce_stats(ctx: DistContext, mean_sums: dict[str, float], *sum_dicts: dict[str, float]) -> None:
    """In place, on every rank: ``mean_sums`` averaged over ranks, each of ``sum_dicts`` summed."""
    if not ctx.distributed:
        return
    dicts = [mean_sums, *sum_dicts]
    keys = [sorted(d) for d in dicts]
    flat = torch.tensor([d[k] for d, ks in zip(dicts, keys, strict=True) for k in ks], dtype=torch.float64)
    width = torch.tensor([flat.numel(), -flat.numel()], dtype=torch.int64)
    ctx.all_reduce(width, "max")
    if int(width[0]) != -int(width[1]):
        raise RuntimeError("ranks report different metric keys: their train steps diverged")
    ctx.all_reduce(flat, "sum")
    i = 0
    for n, (d, ks) in enumerate(zip(dicts, keys, strict=True)):
        for k in ks:
            d[k] = float(flat[i]) / (ctx.world_size if n == 0 else 1)
            i += 1
