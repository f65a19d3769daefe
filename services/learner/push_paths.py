"""The ways a push delivers weights, behind one small interface (`PushPath.deliver`).

`WeightPusher.push` plans (who is a member, which transport each takes, the groups' layout, the send plan)
and announces the version once; then every path that has replicas delivers it and answers for them:

- `IpcPath`: replicas on the learner's GPU read the shared CUDA IPC buffer, already filled while planning;
  they ack on NATS, and the pusher settles those acks before it refills the buffer (the outcome comes later);
- `GroupPath`: one torch group (NCCL, or gloo through host memory), bucketed with a checksum;
- `TensorPath`: SGLang replicas, one broadcast per tensor in a group of their own (per_tensor_push.py).

A path's failure names the replicas to blame when it can tell (the ranks that missed a rendezvous), and
counts towards that path's own failure streak.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

import torch
from structlog.typing import FilteringBoundLogger

from rlbus.learner.per_tensor_push import PerTensorPush
from rlbus.messages import TensorGroup
from rlbus.weight_sync import RendezvousTimeout, SendPlan, WeightSender, WeightSyncError

NamedWeights = Callable[[], Iterable[tuple[str, torch.Tensor]]]


@dataclass(frozen=True)
class PathOutcome:
    """What one path's delivery came to. `settled` is False when its replicas answer later (CUDA IPC acks)."""

    error: str = ""
    to_blame: list[str] | None = None  # the replicas at fault, when the path can tell; None: it cannot
    settled: bool = True


class PushPath(Protocol):
    name: str  # ipc | group | tensor: the failure streak it counts towards
    replicas: list[str]

    async def before_announcement(self) -> None:
        """Puts in place what the replicas must find when the announcement reaches them (a failure shows in
        deliver())."""
        ...

    async def deliver(self, named_weights: NamedWeights, plan: SendPlan) -> PathOutcome:
        """Sends the announced version to this path's replicas (called after the announcement)."""
        ...


@dataclass
class IpcPath:
    replicas: list[str]
    name: str = "ipc"

    async def before_announcement(self) -> None:
        return None  # the buffer was filled while planning

    async def deliver(self, named_weights: NamedWeights, plan: SendPlan) -> PathOutcome:
        return PathOutcome(settled=False)  # the buffer holds the version; each reader acks on NATS


@dataclass
class GroupPath:
    """Rank 0 of the bucketed torch group: forms it when the epoch is new, then streams the buckets."""

    replicas: list[str]
    sender: WeightSender
    port: int
    world: int
    new_group: bool
    epoch: int
    holders: Callable[[tuple[int, ...]], list[str]]  # group ranks -> the replicas that hold them
    log: FilteringBoundLogger  # the service's
    name: str = "group"
    hosting_error: str = ""

    async def before_announcement(self) -> None:
        """A new group's store listens before the replicas read where it is."""
        if not self.new_group:
            return
        try:
            await asyncio.to_thread(self.sender.listen, self.port, self.world)
        except WeightSyncError as exc:
            self.hosting_error = str(exc)

    async def deliver(self, named_weights: NamedWeights, plan: SendPlan) -> PathOutcome:
        if self.hosting_error:
            return PathOutcome(self.hosting_error)
        try:
            if self.new_group:
                self.log.info(
                    "forming weight group", epoch=self.epoch, world=self.world, backend=self.sender.backend
                )
                await asyncio.to_thread(self.sender.open, self.port, self.world, self.epoch)
            await asyncio.to_thread(self.sender.send, named_weights(), plan)
        except RendezvousTimeout as exc:
            self.sender.close()
            return PathOutcome(str(exc), self.holders(exc.missing) if exc.missing else None)
        except WeightSyncError as exc:
            self.sender.close()
            return PathOutcome(str(exc))
        return PathOutcome()


@dataclass
class TensorPath:
    replicas: list[str]
    push: PerTensorPush
    group: TensorGroup
    epoch: int
    name: str = "tensor"

    async def before_announcement(self) -> None:
        return None  # the replicas' engines form their own group

    async def deliver(self, named_weights: NamedWeights, plan: SendPlan) -> PathOutcome:
        return PathOutcome(await self.push.send(self.group, self.epoch, named_weights))
