"""Learner side of the weight push: who gets which transport, announce on NATS, send, recover from failures.

Each live replica gets a transport by rlbus.weight_transport's rule: CUDA IPC for replicas on the learner's
own GPU (one shared buffer, acked per version on NATS), one torch group (NCCL, or gloo through host memory)
for the rest, and a group of their own for SGLang replicas, which take one broadcast per tensor
(per_tensor_push.py). One push may use all of them at once; the checksum, the version announcement and the
never-half-swapped rule are the same for every transport.

A group "epoch" is one fixed membership. When replicas join or leave, the next push forms a new epoch on a
fresh port; a failed push closes the group and the next attempt forms a new one. The learner never blocks
longer than the push timeout, and a push that keeps failing for the same reason stops the run with it.
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import re
import socket
import time
from collections.abc import Iterable
from dataclasses import dataclass
from urllib.parse import urlparse

import torch

from rlbus.learner.per_tensor_push import PerTensorPush
from rlbus.learner.push_members import PushMembership
from rlbus.learner.push_paths import GroupPath, IpcPath, PushPath, TensorPath
from rlbus.messages import (
    IpcBuffer,
    TensorGroup,
    WeightAck,
    WeightAnnouncement,
    decode,
    encode,
)
from rlbus.service import ServiceContext
from rlbus.weight_ipc import IpcWeightSender
from rlbus.weight_sync import (
    Backend,
    SendPlan,
    WeightSender,
    WeightSyncError,
    describe_tensors,
    free_port,
    plan_buckets,
)
from rlbus.weight_transport import (
    DevicePlace,
    PlacementError,
    Transport,
    choose_transport,
    deal_ranks,
    device_place,
    group_backend,
)


class WeightPushFailed(RuntimeError):
    """Pushes failed `trainer.weight_push_max_failures` times in a row for the same reason."""


def weight_sync_host(bus_url: str | None) -> str:
    """Loopback when the bus is local (one box), else this host's address (replicas on other machines)."""
    host = urlparse(bus_url or "nats://127.0.0.1:4222").hostname or "127.0.0.1"
    try:
        if ipaddress.ip_address(host).is_loopback:
            return "127.0.0.1"
    except ValueError:
        if host == "localhost":
            return "127.0.0.1"
    return socket.gethostbyname(socket.gethostname())


def failure_kind(reason: str) -> str:
    """A failure's reason without its ports, sizes and timings: what makes two failures 'the same'."""
    return re.sub(r"\d+(\.\d+)?", "#", reason)[:200]


@dataclass(frozen=True)
class LiveReplica:
    ranks: int  # group ranks it needs (its TP size)
    place: DevicePlace
    ipc_capable: bool
    incarnation: str = ""  # its process start: a restart under the same id is a new member
    per_tensor: bool = False  # receives one broadcast per tensor (SGLang): its own group


class WeightPusher:
    def __init__(self, ctx: ServiceContext, device: torch.device) -> None:
        cfg = ctx.cfg
        self.ctx = ctx
        self.device = device
        self.place = device_place(device)
        self.choice = cfg.trainer.weight_sync_backend
        self.timeout_s = cfg.trainer.weight_push_timeout_s
        self.max_failures = cfg.trainer.weight_push_max_failures
        self.host = cfg.trainer.weight_sync_host or weight_sync_host(cfg.bus.url)
        self.bucket_bytes = cfg.trainer.weight_bucket_mb * 1024 * 1024
        self.sender: WeightSender | None = None
        self.per_tensor = PerTensorPush(self.host, self.timeout_s, cfg.run.id)
        self.ipc: IpcWeightSender | None = None
        self.epoch = 0
        self.ranks: dict[str, int] = {}  # replica id -> rank, of the open torch group
        self.pushed_version = 0
        self.last_seconds = 0.0  # the last push, from preparing it to the announcement (and group send)
        self.last_ack_wait_seconds = 0.0  # before it: waiting for the replicas to let go of the IPC buffer
        self.last_bytes = 0
        self.failures = 0
        self.port = 0
        self.streaks: dict[str, tuple[str, int]] = {}  # path (group | ipc) -> (failure kind, times in a row)
        self.refused: dict[str, str] = {}  # replica id -> why its placement cannot work
        # who may take a push: replicas that answer a roll call; suspects wait out a backoff (in the run's KV)
        self.membership = PushMembership(ctx, cfg.trainer.weight_join_window_s, self.timeout_s)
        self.incarnations: dict[str, str] = {}  # replica id -> incarnation, of the last good push
        self.incarnations_now: dict[str, str] = {}  # the same, of the push under way
        # replica id -> transport of the last good push; None = the next push forms a new epoch
        self.transports: dict[str, Transport] | None = None
        self._acks: asyncio.Queue[WeightAck] = asyncio.Queue()
        self._acks_due: tuple[int, int, set[str]] | None = (
            None  # (version, epoch, replicas) of the last IPC push
        )
        self._sub = None

    async def start(self) -> None:
        """Listen for IPC replicas' acks (core NATS: an ack only matters to the push waiting for it)."""

        async def on_ack(msg) -> None:
            try:
                self._acks.put_nowait(decode(msg.data, WeightAck))
            except Exception as exc:  # noqa: BLE001 - a malformed ack is logged and ignored
                self.ctx.log.warning("bad weight ack", error=str(exc))

        self._sub = await self.ctx.bus.nc.subscribe(self.ctx.bus.names.weight_ack, cb=on_ack)
        await self.membership.load()

    @property
    def status(self) -> str:
        """What the push is waiting on, for the progress line; empty when all is well."""
        if not self.streaks:
            return ""
        kind, count = max(self.streaks.values(), key=lambda kc: kc[1])
        return f"weight push failed {count}x in a row (stops at {self.max_failures}): {kind}"

    async def live_replicas(self) -> dict[str, LiveReplica]:
        """Replicas whose heartbeat is fresh and ready (and whose placement can work), with where they keep
        their weights. A heartbeat is a claim, not evidence: `_members` calls them to the roll."""
        beats = await self.ctx.state.live("rollout", self.ctx.cfg.trainer.replica_timeout_s)
        live = {}
        for hb in beats:
            if hb.status != "ready" or hb.instance_id in self.refused:
                continue
            live[hb.instance_id] = LiveReplica(
                int(hb.stats.get("weight_ranks", 1) or 1),
                DevicePlace.parse(hb.device),
                bool(hb.stats.get("ipc_capable", 0.0)),
                hb.incarnation,
                bool(hb.stats.get("per_tensor_wire", 0.0)),
            )
        return live

    def _same_members(self, transports: dict[str, Transport], live: dict[str, LiveReplica]) -> bool:
        """Whether the last good push reached exactly these replicas, by these transports, in these processes
        (a replica restarted under its id has a new incarnation: it needs a new group and the version)."""
        return self.transports == transports and self.incarnations == {
            rid: live[rid].incarnation for rid in transports
        }

    @staticmethod
    def _incarnations(live: dict[str, LiveReplica]) -> dict[str, str]:
        return {rid: rep.incarnation for rid, rep in live.items()}

    async def _members(self, live: dict[str, LiveReplica]) -> dict[str, LiveReplica]:
        """The live replicas that earned a place in the next push (rlbus.learner.push_members)."""
        last = None if self.transports is None else self.incarnations
        members = await self.membership.admit(self._incarnations(live), last)
        return {rid: live[rid] for rid in members if rid in live}

    async def _blame(self, members: Iterable[str], to_blame: Iterable[str] | None, reason: str) -> None:
        """A push to `members` failed: the membership records who to blame (None: it cannot be told)."""
        incs = {rid: self.incarnations_now.get(rid, "") for rid in members}
        await self.membership.failed(incs, to_blame, failure_kind(reason))

    def _assign(self, live: dict[str, LiveReplica]) -> dict[str, Transport]:
        """Transport per replica; a replica whose placement cannot work is left out, once said why."""
        out: dict[str, Transport] = {}
        for rid, rep in sorted(live.items()):
            try:
                out[rid] = choose_transport(
                    self.choice, self.place, rep.place, rid, replica_ipc=rep.ipc_capable
                )
            except PlacementError as exc:
                if rid not in self.refused:
                    self.refused[rid] = str(exc)
                    self.ctx.log.error(
                        "replica refused: its placement cannot receive weights", replica=rid, reason=str(exc)
                    )
        return out

    async def push(self, named_weights, version: int) -> bool:
        """Sends `version` to every live replica. Returns False (and logs why) when the push failed."""
        live = await self._members(await self.live_replicas())
        self.incarnations_now = self._incarnations(live)
        transports = self._assign(live)
        if not transports:
            self.transports, self.ranks, self.incarnations = {}, {}, {}
            self.pushed_version = version
            return True
        ipc_ids = sorted(r for r, t in transports.items() if t == "cuda_ipc")
        tensor_ids = sorted(r for r, t in transports.items() if t != "cuda_ipc" and live[r].per_tensor)
        group_ids = sorted(r for r, t in transports.items() if t != "cuda_ipc" and not live[r].per_tensor)
        backend = group_backend(transports[r] for r in group_ids)
        t_acks = time.perf_counter()
        if ipc_ids:
            await self._settle_acks()  # the shared buffer is refilled only once every reader let go of it
        else:
            self._acks_due = None
        t0 = time.perf_counter()
        self.last_ack_wait_seconds = t0 - t_acks
        try:
            plan, ipc_buffer = await asyncio.to_thread(
                self._prepare, named_weights, bool(group_ids), bool(ipc_ids), backend
            )
        except (WeightSyncError, torch.cuda.OutOfMemoryError) as exc:
            self.transports = None
            return self._failed(version, f"preparing the push: {exc}", "group")
        try:
            ranks, world, port, new_group = self._group_layout(transports, live, group_ids)
            tensor_group = self.per_tensor.layout(
                {r: live[r].ranks for r in tensor_ids},
                self.epoch,
                group_backend(transports[r] for r in tensor_ids) or "gloo",
            )
        except OSError as exc:
            self.transports = None
            return self._failed(version, f"no port for the weight group on {self.host}: {exc}", "group")
        ann = self._announcement(
            version, plan, (port, world, ranks, backend, new_group), ipc_ids, ipc_buffer, tensor_group
        )
        paths: list[PushPath] = []
        if ipc_ids:
            paths.append(IpcPath(ipc_ids))
        if group_ids:
            assert self.sender is not None  # made while preparing, for the group
            holders = functools.partial(self._holders, ranks, live)
            paths.append(
                GroupPath(group_ids, self.sender, port, world, new_group, self.epoch, holders, self.ctx.log)
            )
        if tensor_group is not None:
            paths.append(TensorPath(tensor_ids, self.per_tensor, tensor_group, self.epoch))
        while not self._acks.empty():  # acks of an earlier push that timed out
            self._acks.get_nowait()
        for path in paths:
            await path.before_announcement()
        await self.ctx.state.put_announcement(encode(ann))
        settled = await self._deliver(paths, named_weights, plan, version)
        if settled is None:
            return False
        self.transports, self.ranks = transports, ranks
        self.incarnations = {rid: live[rid].incarnation for rid in transports}
        await self.membership.succeeded(settled)
        self.port = port
        self.pushed_version = version
        self.last_seconds = time.perf_counter() - t0
        self.last_bytes = plan.total_bytes
        self.ctx.log.info(
            "weights pushed",
            version=version,
            epoch=self.epoch,
            ipc=len(ipc_ids),
            group=f"{backend}:{len(group_ids)}" if group_ids else "none",
            per_tensor=len(tensor_ids),
            seconds=round(self.last_seconds, 4),
        )
        return True

    async def _deliver(
        self, paths: list[PushPath], named_weights, plan: SendPlan, version: int
    ) -> list[str] | None:
        """Each path sends the announced version; returns the replicas that took it now, or None when a
        path failed (its replicas blamed, the failure counted on its streak)."""
        settled: list[str] = []
        for path in paths:
            outcome = await path.deliver(named_weights, plan)
            if outcome.error:
                self.transports = None
                await self._blame(path.replicas, outcome.to_blame, outcome.error)
                self._failed(version, outcome.error, path.name)  # raises at the streak's limit
                return None
            if outcome.settled:
                self.streaks.pop(path.name, None)
                settled += path.replicas
            else:  # acks are collected before the next refill, not here: the step goes on meanwhile
                self._acks_due = (version, self.epoch, set(path.replicas))
        return settled

    def _announcement(
        self,
        version: int,
        plan: SendPlan,
        group: tuple[int, int, dict[str, int], Backend | None, bool],
        ipc_ids: list[str],
        ipc_buffer: dict | None,
        tensor_group: TensorGroup | None,
    ) -> WeightAnnouncement:
        """What replicas read before a push: the groups (port, world, ranks, backend, whether it forms now),
        the IPC buffer and its readers, the per-tensor group, and the plan's names, shapes and checksum."""
        port, world, ranks, backend, new_group = group
        return WeightAnnouncement(
            run_id=self.ctx.cfg.run.id,
            version=version,
            epoch=self.epoch,
            master_addr=self.host,
            master_port=port,
            world_size=world,
            ranks=ranks,
            backend=backend or "gloo",
            ipc_replicas=ipc_ids,
            ipc_buffer=IpcBuffer(**ipc_buffer) if ipc_buffer else None,
            new_group=new_group,
            tensor_group=tensor_group,
            timeout_s=self.timeout_s,
            **plan.announcement_fields(),
        )

    def _group_layout(
        self, transports: dict[str, Transport], live: dict[str, LiveReplica], group_ids: list[str]
    ) -> tuple[dict[str, int], int, int, bool]:
        """(ranks, world size, port, whether the group is new): the same group when its members are, else
        a new epoch with ranks dealt in order and a fresh port (OSError when none is free)."""
        reform = not self._same_members(transports, live) or (
            bool(group_ids) and (self.sender is None or not self.sender.is_open)
        )
        if not reform:
            return self.ranks, 1 + sum(live[r].ranks for r in group_ids), self.port, False
        self.epoch += 1  # a replica skips an (epoch, version) it already took: a new epoch is always news
        ranks, nxt = deal_ranks({rid: live[rid].ranks for rid in group_ids})
        return ranks, nxt, (free_port(self.host) if group_ids else 0), bool(group_ids)

    def _prepare(
        self, named_weights, group: bool, ipc: bool, backend: Backend | None
    ) -> tuple[SendPlan, dict | None]:
        """The plan (names, shapes, buckets, checksum), with the IPC buffer filled when IPC replicas need it."""
        if group and (self.sender is None or self.sender.backend != backend):
            if self.sender is not None:
                self.sender.close()
            self.sender = WeightSender(
                backend=backend or "gloo",
                host=self.host,
                timeout_s=self.timeout_s,
                bucket_bytes=self.bucket_bytes,
                device=self.device if backend == "nccl" else None,
            )
            self.transports = None
        if ipc:  # one pass fills the shared buffer and gives the plan the torch group (if any) sends by
            if self.ipc is None:
                self.ipc = IpcWeightSender(self.device)
            metas, checksum = self.ipc.fill(named_weights())
            return SendPlan(metas, plan_buckets(metas, self.bucket_bytes), checksum), self.ipc.handle
        if not group:  # only per-tensor replicas: names, dtypes and shapes (SGLang checks no sum)
            metas = describe_tensors(named_weights())
            return SendPlan(metas, plan_buckets(metas, self.bucket_bytes), 0.0), None
        assert self.sender is not None  # made above for the group
        return self.sender.plan(named_weights()), None

    @staticmethod
    def _holders(ranks: dict[str, int], live: dict[str, LiveReplica], missing: tuple[int, ...]) -> list[str]:
        """The replicas holding the group ranks that missed the rendezvous."""
        return sorted(
            rid for rid, first in ranks.items() if any(first <= r < first + live[rid].ranks for r in missing)
        )

    async def _settle_acks(self) -> None:
        """Acks of the last CUDA IPC push. A replica that read a bad copy or stayed silent makes that push a
        failure (counted towards the streak) and the next push a new epoch, so it takes the version again."""
        if self._acks_due is None:
            return
        version, epoch, waiting = self._acks_due
        waiting_all = set(waiting)
        self._acks_due = None
        error = await self._wait_acks(waiting, version, epoch)
        if error:
            self.transports = None
            # the silent ones get a strike (a reader that answered "bad copy" is alive)
            await self._blame(waiting_all, waiting, error)
            self._failed(version, error, "ipc")
        else:
            self.streaks.pop("ipc", None)
            await self.membership.succeeded(waiting_all)

    async def _wait_acks(self, waiting: set[str], version: int, epoch: int) -> str:
        """Every IPC replica's ack for this version; a silent one fails the push after the push timeout."""
        deadline = time.monotonic() + self.timeout_s
        bad: list[str] = []
        while waiting:
            left = deadline - time.monotonic()
            if left <= 0:
                bad.append(f"no CUDA IPC ack within {self.timeout_s:.0f}s from {sorted(waiting)}")
                break
            try:
                ack = await asyncio.wait_for(self._acks.get(), timeout=left)
            except TimeoutError:
                continue
            if ack.version != version or ack.epoch != epoch or ack.replica_id not in waiting:
                continue
            waiting.discard(ack.replica_id)
            if not ack.ok:
                bad.append(f"{ack.replica_id}: {ack.detail}")
        return "; ".join(bad)

    def _failed(self, version: int, reason: str, path: str) -> bool:
        """Counts a failure of one path (the torch group, or the IPC readers); the same reason
        `trainer.weight_push_max_failures` times in a row on a path stops the run with it."""
        self.failures += 1
        kind = failure_kind(reason)
        last_kind, count = self.streaks.get(path, ("", 0))
        count = count + 1 if kind == last_kind else 1
        self.streaks[path] = (kind, count)
        self.ctx.log.warning(
            "weight push failed; will re-form the group",
            version=version,
            epoch=self.epoch,
            path=path,
            streak=count,
            error=reason,
        )
        if count >= self.max_failures:
            raise WeightPushFailed(
                f"the weight push failed {count} times in a row for the same reason: {reason} "
                f"(trainer.weight_push_max_failures={self.max_failures}; trainer.weight_sync_backend="
                f"{self.choice})"
            )
        return False

    async def maintain(self, named_weights, version: int) -> None:
        """Called while waiting for data: serve late joiners and retry failed pushes."""
        replicas = await self.live_replicas()
        last = None if self.transports is None else self.incarnations
        same = self.membership.plan(self._incarnations(replicas), last).keep
        if version == 0:
            # Everyone starts from the same checkpoint on disk: nothing to send yet.
            self.transports = self.transports if same else None
            return
        if self.pushed_version < version or not same:
            await self.push(named_weights, version)
        elif self._acks_due is not None and self._acks.qsize() >= len(self._acks_due[2]):
            await self._settle_acks()  # all acks are in: learn now whether a replica failed its read

    def close(self) -> None:
        self.per_tensor.close()
        if self.sender is not None:
            self.sender.close()
        if self.ipc is not None:
            self.ipc.close()
