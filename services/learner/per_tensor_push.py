"""The SGLang replicas' share of a weight push: a group of their own per epoch, one broadcast per tensor.

SGLang receives through its own endpoints (`/init_weights_update_group`, `/update_weights_from_distributed`),
which take tensors one broadcast each, in announcement order, with no bucket framing or checksum
(rlbus.weight_sync.per_tensor). Replicas that say so in their heartbeat (`per_tensor_wire`) are taken out
of the bucketed group and announced in `WeightAnnouncement.tensor_group` instead.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable

import torch

from rlbus.messages import TensorGroup
from rlbus.weight_sync import free_port
from rlbus.weight_sync.per_tensor import PerTensorSender, per_tensor_group_name
from rlbus.weight_transport import deal_ranks


class PerTensorPush:
    """Rank 0 of the per-tensor group: formed once per epoch, reused by every push of that epoch."""

    def __init__(self, host: str, timeout_s: float, run_id: str) -> None:
        self.host = host
        self.timeout_s = timeout_s
        self.run_id = run_id
        self.sender: PerTensorSender | None = None
        self.group: TensorGroup | None = None  # the group `sender` hosts
        self.epoch = -1

    def layout(self, replica_ranks: dict[str, int], epoch: int, backend: str) -> TensorGroup | None:
        """The group for these replicas (id -> ranks it needs): the open one in the same epoch, else a new
        one on a fresh port (OSError when none is free). None when there are no such replicas."""
        if not replica_ranks:
            return None
        if self.group is not None and self.epoch == epoch and self.sender is not None and self.sender.is_open:
            return self.group
        ranks, nxt = deal_ranks(replica_ranks)
        return TensorGroup(
            master_port=free_port(self.host),
            world_size=nxt,
            ranks=ranks,
            backend="nccl" if backend == "nccl" else "gloo",
            group_name=per_tensor_group_name(self.run_id, epoch),
        )

    async def send(
        self, group: TensorGroup, epoch: int, named_weights: Callable[[], Iterable[tuple[str, torch.Tensor]]]
    ) -> str:
        """Forms the group when it is new, then broadcasts every tensor; returns the error, or ''."""
        try:
            if group is not self.group:
                self.close()
                sender = PerTensorSender(group.backend, self.timeout_s)
                await asyncio.to_thread(
                    sender.open, self.host, group.master_port, group.world_size, group.group_name
                )
                self.sender, self.group, self.epoch = sender, group, epoch
            assert self.sender is not None
            await asyncio.to_thread(self.sender.send, named_weights())
        except Exception as exc:  # noqa: BLE001 - a dead or timed-out peer: the group is gone
            self.close()
            return f"per-tensor group: {type(exc).__name__}: {exc}"
        return ""

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()
        self.sender, self.group, self.epoch = None, None, -1
