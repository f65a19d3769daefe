"""The per-tensor wire of SGLang's weight-update group, both ends.

SGLang's workers join a torch process group themselves (`/init_weights_update_group`: torch's
`rendezvous` on tcp://addr:port, then `PrefixStore(group_name)` and `_new_process_group_helper`, rank =
rank_offset + tp_rank) and receive with `/update_weights_from_distributed`: ONE broadcast PER TENSOR, in
the order of the names they were given, from rank 0, with no header, trailer or checksum. That is not the
bucketed protocol of the rest of this package, so SGLang replicas get their own group.

`PerTensorSender` is rank 0 (the learner's pusher); `join_per_tensor_group` is what SGLang's
`init_custom_process_group` does, kept here so the pusher can be tested against the same rendezvous
without an SGLang server. Pure torch.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import timedelta
from typing import Any, cast

import torch
import torch.distributed as dist


def per_tensor_group_name(run_id: str, epoch: int) -> str:
    """The store prefix (and SGLang's group name) of one epoch's per-tensor group."""
    return f"rlbus_{run_id}_epoch{epoch}"


def join_per_tensor_group(
    master_addr: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str,
    backend: str,
    timeout_s: float,
) -> Any:
    """A torch process group built as SGLang's `init_custom_process_group` builds it (rank 0 hosts the
    TCPStore); every rank of the group calls it, rank 0 through `PerTensorSender.open`."""
    from torch.distributed.distributed_c10d import (
        Backend,
        PrefixStore,
        _new_process_group_helper,
        _world,
        rendezvous,
    )

    timeout = timedelta(seconds=timeout_s)
    store, rank, world = next(
        rendezvous(f"tcp://{master_addr}:{master_port}", rank, world_size, timeout=timeout)
    )
    store.set_timeout(timeout)
    pg, _ = _new_process_group_helper(
        world,
        rank,
        [],
        Backend(backend),
        PrefixStore(group_name, store),
        group_name=cast(Any, group_name),  # torch's GroupName is a str NewType
        timeout=timeout,
    )
    _world.pg_group_ranks[pg] = {i: i for i in range(world)}
    return pg


class PerTensorSender:
    """Rank 0 of a per-tensor group: hosts the rendezvous, then broadcasts each tensor in order."""

    def __init__(self, backend: str = "nccl", timeout_s: float = 120.0) -> None:
        self.backend = backend
        self.timeout_s = float(timeout_s)
        self._pg: Any = None

    @property
    def is_open(self) -> bool:
        return self._pg is not None

    def open(self, master_addr: str, master_port: int, world_size: int, group_name: str) -> None:
        """Blocks until every member joined (SGLang's ranks join when they are POSTed the group)."""
        self.close()
        self._pg = join_per_tensor_group(
            master_addr, master_port, 0, world_size, group_name, self.backend, self.timeout_s
        )

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """One broadcast per tensor, in the order the announcement lists them; returns the bytes sent."""
        if self._pg is None:
            raise RuntimeError("open() the per-tensor weight group first")
        sent = 0
        for _, tensor in named_tensors:
            t = tensor.detach().contiguous()
            dist.broadcast(t, src=0, group=self._pg)
            sent += t.numel() * t.element_size()
        return sent

    def close(self) -> None:
        pg, self._pg = self._pg, None
        if pg is not None:
            try:
                dist.destroy_process_group(pg)
            except Exception:  # noqa: BLE001 - best effort on a dead group
                pass
