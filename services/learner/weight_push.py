"""Learner side of the weight push: who is in the group, announce on NATS, broadcast, recover from failures.

A group "epoch" is one fixed membership. When replicas join or leave, the next push forms a new epoch
on a fresh port; a failed push (a replica died mid-broadcast) closes the group and the next attempt
forms a new one without the silent member. The learner never blocks longer than the push timeout.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import time
from urllib.parse import urlparse

from rlbus.messages import WeightAnnouncement, encode
from rlbus.service import ServiceContext


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


class WeightPusher:
    def __init__(self, ctx: ServiceContext, backend: str) -> None:
        from rlbus.weight_sync import WeightSender

        cfg = ctx.cfg
        self.ctx = ctx
        self.backend = backend
        self.host = cfg.trainer.weight_sync_host or weight_sync_host(cfg.bus.url)
        self.sender = WeightSender(backend=backend, host=self.host, timeout_s=cfg.trainer.weight_push_timeout_s,
                                   bucket_bytes=cfg.trainer.weight_bucket_mb * 1024 * 1024)
        self.epoch = 0
        self.members: dict[str, int] | None = None  # replica id -> rank, of the open group
        self.pushed_version = 0
        self.last_seconds = 0.0
        self.last_bytes = 0
        self.failures = 0
        self.port = 0

    async def live_replicas(self) -> dict[str, int]:
        """Replica id -> ranks it needs (its TP size), for replicas whose heartbeat is fresh."""
        beats = await self.ctx.state.live("rollout", self.ctx.cfg.trainer.replica_timeout_s)
        return {hb.instance_id: int(hb.stats.get("weight_ranks", 1) or 1) for hb in beats if hb.status == "ready"}

    def _assign_ranks(self, live: dict[str, int]) -> dict[str, int]:
        ranks, nxt = {}, 1
        for rid in sorted(live):
            ranks[rid] = nxt
            nxt += live[rid]
        return ranks

    async def push(self, named_weights, version: int) -> bool:
        """Sends `version` to every live replica. Returns False (and logs why) when the push failed."""
        from rlbus.weight_sync import WeightSyncError, free_port

        live = await self.live_replicas()
        if not live:
            self.members = {}
            self.pushed_version = version
            return True
        new_group = self.members is None or set(live) != set(self.members) or not self.sender.is_open
        # Two streamed passes (plan: names, shapes, checksum; then send): never the whole model at once, and
        # under FSDP each pass is one all-gather per tensor that every rank joins (rlbus.learner.parallel).
        plan = await asyncio.to_thread(self.sender.plan, named_weights())
        if new_group:
            self.sender.close()
            self.epoch += 1
            ranks = self._assign_ranks(live)
            world = 1 + sum(live.values())
            port = free_port(self.host)
        else:
            assert self.members is not None
            ranks, world, port = self.members, 1 + sum(live[r] for r in self.members), self.port
        ann = WeightAnnouncement(
            run_id=self.ctx.cfg.run.id, version=version, epoch=self.epoch, master_addr=self.host,
            master_port=port, world_size=world, ranks=ranks, backend=self.backend,
            names=[m.name for m in plan.metas], dtypes=[m.dtype for m in plan.metas],
            shapes=[list(m.shape) for m in plan.metas], buckets=plan.buckets, checksum=plan.checksum,
        )
        t0 = time.perf_counter()
        await self.ctx.state.put_announcement(encode(ann))
        try:
            if new_group:
                self.ctx.log.info("forming weight group", epoch=self.epoch, world=world, replicas=sorted(ranks))
                await asyncio.to_thread(self.sender.open, port, world, self.epoch)
            await asyncio.to_thread(self.sender.send, named_weights(), plan)
        except WeightSyncError as exc:
            self.failures += 1
            self.ctx.log.warning("weight push failed; will re-form the group", version=version, epoch=self.epoch,
                                 error=str(exc))
            self.sender.close()
            self.members = None
            return False
        self.members = ranks
        self.port = port
        self.pushed_version = version
        self.last_seconds = time.perf_counter() - t0
        self.last_bytes = int(getattr(self.sender, "last_send_bytes", 0))
        self.ctx.log.info("weights pushed", version=version, epoch=self.epoch, replicas=len(ranks),
                          seconds=round(self.last_seconds, 3))
        return True

    async def maintain(self, named_weights, version: int) -> None:
        """Called while waiting for data: serve late joiners and retry failed pushes."""
        live = await self.live_replicas()
        members = set(self.members or {})
        if version == 0:
            # Everyone starts from the same checkpoint on disk: nothing to send yet.
            self.members = self.members if members == set(live) else None
            return
        if self.pushed_version < version or members != set(live):
            await self.push(named_weights, version)

    def close(self) -> None:
        self.sender.close()
