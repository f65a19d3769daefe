"""What every service process shares: bus connection, heartbeats, health endpoint, graceful stop."""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import socket
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlbus.config import RlbusConfig
from rlbus.logs import get_logger, setup_logging
from rlbus.messages import HOLDING_MAX, Heartbeat

EXIT_REFUSED = 2  # a service's configuration cannot work: supervisors must not restart it (rlbus up stops)
EXIT_STALLED = 3  # the learner waited past trainer.batch_timeout_s for data: a restart may get it going
EXIT_PUSH_FAILED = (
    4  # weight pushes failed for one reason weight_push_max_failures times: a restart would too
)
HEARTBEAT_INTERVAL_S = 2.0
HEARTBEAT_STATUS_POLL_S = 0.25  # how soon a status change goes out


@dataclass
class ServiceContext:
    cfg: RlbusConfig
    service: str
    instance_id: str
    bus: Any  # rlbus.bus.Bus
    state: Any  # rlbus.bus.RunState
    stop: asyncio.Event
    log: Any
    stats: dict[str, float] = field(default_factory=dict)
    policy_version: int = 0
    status: str = "starting"
    device: str = ""  # where this service keeps its weights, as rlbus.weight_transport.DevicePlace prints it
    health: Any = None
    metrics: Any = None
    incarnation: str = field(default_factory=lambda: uuid.uuid4().hex[:12])  # this process start
    beat_due: bool = False  # set by beat_soon: the heartbeat loop beats at once
    holding: list[str] = field(default_factory=list)  # ack subjects of the work held now (Heartbeat.holding)
    _beat_wake: asyncio.Event = field(default_factory=asyncio.Event, repr=False)

    def mark_ready(self) -> None:
        """Set up and serving. The objects made so far (imports, model, data) live as long as the process:
        `gc.freeze` keeps the collector from walking them again. Without it a full collection walked them
        every dozen steps of the 2-core demo and stalled the learner ~200 ms (vLLM and SGLang freeze too)."""
        gc.collect()
        gc.freeze()
        self.status = "ready"

    def _duplicate_conflicts(self) -> int:
        """Publishes this process made that JetStream dropped because another message held their id."""
        from rlbus.bus.duplicates import DuplicateVerdict

        return int(getattr(self.bus, "duplicates", {}).get(DuplicateVerdict.DIFFERENT, 0))

    def beat_soon(self) -> None:
        """Heartbeat now rather than at the next interval: the learner waits for a fresh beat from each member
        of a failed weight push before it forms the next group, and reads what a dead replica held from its
        last beat."""
        self.beat_due = True
        self._beat_wake.set()

    async def until_beat_due(self, seconds: float) -> bool:
        """Waits `seconds`, or until a beat is asked for (`beat_soon`) or the service stops; True on stop."""
        waiting = {asyncio.ensure_future(self._beat_wake.wait()), asyncio.ensure_future(self.stop.wait())}
        try:
            await asyncio.wait(waiting, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in waiting:
                task.cancel()
        self._beat_wake.clear()
        return self.stop.is_set()

    def hold(self, ack_subjects: list[str]) -> None:
        """The work held from now on (what the last beat names if this process dies); beats at once when
        there is new work to name, so that beat is current."""
        self.holding = ack_subjects
        if ack_subjects:
            self.beat_soon()

    @property
    def run_dir(self) -> Path:
        return Path(self.cfg.run.dir) / self.cfg.run.id

    async def sleep_or_stop(self, seconds: float) -> bool:
        """Sleeps, waking early on stop; returns True when the service should stop."""
        try:
            await asyncio.wait_for(self.stop.wait(), timeout=seconds)
        except TimeoutError:
            return False
        return True

    def heartbeat(self) -> Heartbeat:
        return Heartbeat(
            run_id=self.cfg.run.id,
            service=self.service,
            instance_id=self.instance_id,
            policy_version=self.policy_version,
            time=time.time(),
            status=self.status,
            stats={**self.stats, "duplicate_conflicts": float(self._duplicate_conflicts())},
            host=socket.gethostname(),
            device=self.device,
            incarnation=self.incarnation,
            holding=self.holding[:HOLDING_MAX],
        )


def default_instance_id(service: str) -> str:
    return f"{service}-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:4]}"


async def _heartbeat_loop(ctx: ServiceContext) -> None:
    """Beats every HEARTBEAT_INTERVAL_S, and at once when the status changes (so `ready` is seen
    without waiting for the next beat) or the service asks (`beat_soon`)."""
    sent_status: str | None = None
    sent_at = float("-inf")
    while not ctx.stop.is_set():
        if ctx.health is not None:
            ctx.health.set_ready(ctx.status == "ready", reason=ctx.status)
        if ctx.beat_due or ctx.status != sent_status or time.monotonic() - sent_at >= HEARTBEAT_INTERVAL_S:
            sent_status, sent_at, ctx.beat_due = ctx.status, time.monotonic(), False
            try:
                await ctx.state.heartbeat(ctx.heartbeat())
            except Exception as exc:  # the bus may be reconnecting; heartbeats resume by themselves
                ctx.log.warning("heartbeat failed", error=str(exc))
        if await ctx.until_beat_due(HEARTBEAT_STATUS_POLL_S):
            break


async def run_service(
    cfg: RlbusConfig, service: str, instance_id: str | None, body: Callable[[ServiceContext], Awaitable[int]]
) -> int:
    """Connects, starts heartbeats and health, runs `body` until it returns or SIGTERM/SIGINT arrives."""
    from rlbus.bus import Bus, resolve_bus_url

    instance_id = instance_id or default_instance_id(service)
    setup_logging(cfg.logging.level, cfg.logging.json_logs, service=instance_id)
    log = get_logger(service)
    run_dir = Path(cfg.run.dir) / cfg.run.id
    url, server = resolve_bus_url(cfg.bus, run_dir)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    health = metrics = None
    if cfg.run.health_port:
        from rlbus.health import HealthServer

        health = HealthServer(cfg.run.health_port, service)
        await _maybe_await(health.start())
        metrics = getattr(health, "metrics", None)

    bus = await Bus.open(cfg, url, name=instance_id)
    try:
        state = await bus.state()
        ctx = ServiceContext(
            cfg=cfg,
            service=service,
            instance_id=instance_id,
            bus=bus,
            state=state,
            stop=stop,
            log=log,
            health=health,
            metrics=metrics,
        )
        hb = asyncio.create_task(_heartbeat_loop(ctx))
        from rlbus.bus import redact_url

        torch = sys.modules.get("torch")  # the threads it computes with: rlbus up shares the cores out
        threads = torch.get_num_threads() if torch is not None else None
        log.info("service started", bus=redact_url(url), run=cfg.run.id, torch_threads=threads)
        try:
            rc = await body(ctx)
        finally:
            stop.set()
            hb.cancel()
            try:
                await state.remove(service, instance_id)
            except Exception:  # best effort: an expired heartbeat ages out anyway
                pass
        log.info("service stopped", rc=rc)
        return rc
    finally:
        await bus.close()
        if health is not None:
            health.stop()
        if server is not None:
            server.stop()


async def _maybe_await(value: Any) -> Any:
    if asyncio.iscoroutine(value):
        return await value
    return value


def run_sync(coro_factory: Callable[[], Coroutine[Any, Any, int]]) -> int:
    return asyncio.run(coro_factory())
