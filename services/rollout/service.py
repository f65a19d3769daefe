"""The rollout loop: pull prompt work, wait until our weights are new enough, generate, publish, ack.

Weight pushes arrive on a second task and are applied between generation batches (one lock guards
the engine), so a replica never generates with half-swapped weights.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import TYPE_CHECKING

from rlbus.bus.keepalive import held_work_ack_wait, keepalive_every, kept_alive
from rlbus.config import RlbusConfig
from rlbus.messages import (
    PromptWork,
    Sample,
    TrajectoryGroup,
    WeightAck,
    WeightAnnouncement,
    decode,
    encode,
)
from rlbus.service import ServiceContext, run_service
from rlbus.stoppable import StoppedDuringStart, leave_if_start_abandoned, on_own_thread, unless_stopped

if TYPE_CHECKING:
    from rlbus.bus.consumer import Delivery
    from rlbus.rollout.admission import RequestLimits
    from rlbus.rollout.engines.base import RolloutEngine

    Work = Delivery[PromptWork]  # one prompt's work item, as the replica fetches it

SUPERSEDED_CHECK_S = 2.0  # how long a replica asks whether a newer weight push is out before joining this one


class Replica:
    def __init__(self, ctx: ServiceContext, engine) -> None:
        self.ctx = ctx
        self.engine = engine
        self.keepalive_s = keepalive_every(ctx.cfg.bus.ack_wait_s)
        self.lock = asyncio.Lock()
        self.version = 0  # the model on disk is policy version 0
        self.version_changed = asyncio.Condition()
        self.last_announcement: tuple[int, int] | None = None  # (epoch, version) last taken part in
        self.joined_epoch: int | None = None  # the torch group this process is a member of
        self.last_pass_s = 0.0  # the engine's last generation call: what a partial batch may wait for more

    async def _set_version(self, version: int) -> None:
        async with self.version_changed:
            self.version = version
            self.ctx.policy_version = version
            self.version_changed.notify_all()

    async def wait_for_version(self, needed: int, timeout_s: float, deliveries: list[Work]) -> bool:
        """Waits until our weights are at least `needed`, keeping the held work alive meanwhile."""
        deadline = time.monotonic() + timeout_s
        while self.version < needed:
            left = deadline - time.monotonic()
            if left <= 0 or self.ctx.stop.is_set():
                return False
            self.ctx.log.info("waiting for weights", have=self.version, need=needed)
            async with self.version_changed:
                try:
                    await asyncio.wait_for(self.version_changed.wait(), timeout=min(left, self.keepalive_s))
                except TimeoutError:
                    pass
            for d in deliveries:
                await d.in_progress()
        return True

    async def weight_loop(self) -> None:
        """Takes part in every broadcast the learner announces with us as a member."""
        replica_id = self.ctx.instance_id
        own_timeout = self.ctx.cfg.trainer.weight_push_timeout_s  # only for an announcement without one
        async for raw in self.ctx.state.watch_announcements():
            if self.ctx.stop.is_set():
                return
            try:
                ann = decode(raw, WeightAnnouncement)
            except Exception as exc:
                self.ctx.log.error("bad weight announcement", error=str(exc))
                continue
            key = (ann.epoch, ann.version)
            if key == self.last_announcement:
                continue
            per_tensor = ann.tensor_group is not None and replica_id in ann.tensor_group.ranks
            if replica_id not in ann.ranks and replica_id not in ann.ipc_replicas and not per_tensor:
                continue
            # a newer push is out: joining this one would wait on a dead group
            if await self._superseded(key):
                continue
            if replica_id in ann.ipc_replicas:
                self.last_announcement = key
                await self._take_ipc(ann)
                continue
            if not per_tensor and not ann.new_group and ann.epoch != self.joined_epoch:
                # a group formed before this process (its predecessor under our id): the learner re-forms
                # the group when it sees our new incarnation
                self.last_announcement = key
                continue
            self.last_announcement = key
            t0 = time.perf_counter()
            try:
                # an engine guarding its own swap receives beside generation: no wait for a batch
                guard = contextlib.nullcontext() if self.engine.receives_while_generating else self.lock
                async with guard:
                    rank = (
                        ann.tensor_group.ranks[replica_id]
                        if per_tensor and ann.tensor_group
                        else ann.ranks[replica_id]
                    )
                    timeout = ann.timeout_s or own_timeout  # the learner's: both ends wait as long
                    await asyncio.to_thread(self.engine.receive_weights, ann, rank, timeout)
            except Exception as exc:  # the learner notices too, and re-forms the group
                self.ctx.log.error(
                    "weight receive failed", version=ann.version, epoch=ann.epoch, error=str(exc)
                )
                self.ctx.beat_soon()  # proof of life: the learner re-forms the group without us until then
                continue
            self.ctx.stats["weight_recv_s"] = time.perf_counter() - t0
            self.joined_epoch = ann.epoch
            await self._set_version(ann.version)
            self.ctx.log.info(
                "weights updated",
                version=ann.version,
                epoch=ann.epoch,
                seconds=round(self.ctx.stats["weight_recv_s"], 3),
            )

    async def answer_roll_calls(self) -> None:
        """Answer the learner's roll calls: a weight group takes only replicas that answer, so a heartbeat
        alone (a forged one, or a dead process's last) never holds a push up."""
        from rlbus.bus.roll_call import answer_roll_calls

        bus = self.ctx.bus
        await answer_roll_calls(bus.nc, bus.names, self.ctx.instance_id, self.ctx.incarnation, self.ctx.log)

    async def _superseded(self, key: tuple[int, int]) -> bool:
        """Whether the current announcement is newer than `key` (this one waited behind a long receive, or
        is the last one a dead learner attempt left in the store)."""
        try:  # briefly: the learner's broadcast is waiting on us (a read retried through a NATS failover ran
            # 30 s, and the push timed out on us)
            raw = await asyncio.wait_for(self.ctx.state.get_announcement(), SUPERSEDED_CHECK_S)
            latest = decode(raw, WeightAnnouncement) if raw else None
        except Exception as exc:  # noqa: BLE001 - cannot tell: take part in this one
            self.ctx.log.warning("cannot read the current weight announcement", error=repr(exc))
            return False
        # newer only: a read served by a server still catching up after a NATS failover can return the
        # announcement before this one, and skipping on it left the learner's broadcast waiting out its 30 s
        # (test_bus_cluster, 2026-12-07). Epochs and versions only grow, across learner attempts too (a resumed
        # learner's epochs start past the crashed attempt's)
        if latest is not None and (latest.epoch, latest.version) > key:
            self.ctx.log.info("weight announcement superseded: skipped", skipped=key,
                              current=(latest.epoch, latest.version))  # fmt: skip
            return True
        return False

    async def _ack(self, ann: WeightAnnouncement, ok: bool, detail: str = "") -> None:
        ack = WeightAck(
            replica_id=self.ctx.instance_id, version=ann.version, epoch=ann.epoch, ok=ok, detail=detail
        )
        try:
            await self.ctx.bus.nc.publish(self.ctx.bus.names.weight_ack, encode(ack))
        except Exception as exc:  # the learner times this push out and retries
            self.ctx.log.warning("weight ack not sent", error=str(exc))

    async def _take_ipc(self, ann: WeightAnnouncement) -> None:
        """CUDA IPC: copy the version out of the learner's buffer (generation goes on meanwhile), ack so
        the learner may refill it, then swap it in between generation batches."""
        t0 = time.perf_counter()
        try:
            received = await asyncio.to_thread(self.engine.take_ipc_weights, ann)
        except Exception as exc:  # noqa: BLE001 - a bad read is reported, never loaded
            self.ctx.log.error(
                "weight receive failed",
                version=ann.version,
                epoch=ann.epoch,
                transport="cuda_ipc",
                error=str(exc),
            )
            await self._ack(ann, False, str(exc))
            return
        await self._ack(ann, True)
        async with self.lock:
            await asyncio.to_thread(self.engine.load_received, received, ann.version)
        del received
        self.ctx.stats["weight_recv_s"] = time.perf_counter() - t0
        await self._set_version(ann.version)
        self.ctx.log.info(
            "weights updated",
            version=ann.version,
            epoch=ann.epoch,
            transport="cuda_ipc",
            seconds=round(self.ctx.stats["weight_recv_s"], 4),
        )

    async def generate_each(self, works: list[PromptWork]) -> tuple[list[TrajectoryGroup | Exception], int]:
        """`generate`, but an engine error costs only the item that caused it: on a failed batch each item
        is tried alone, and the ones that still fail come back as their exception."""
        try:
            groups, tokens = await self.generate(works)
            return list(groups), tokens
        except Exception as exc:  # noqa: BLE001 - an engine error on some item; find which
            if len(works) == 1:
                return [exc], 0
            self.ctx.log.warning(
                "batch generation failed; trying its items one by one", error=(str(exc) or repr(exc))[:300]
            )
        outcomes: list[TrajectoryGroup | Exception] = []
        total = 0
        for work in works:
            try:
                groups, tokens = await self.generate([work])
                outcomes.append(groups[0])
                total += tokens
            except Exception as exc:  # noqa: BLE001
                outcomes.append(exc)
        return outcomes, total

    async def generate(self, works: list[PromptWork]) -> tuple[list[TrajectoryGroup], int]:
        from rlbus.rollout.engines.base import GenerationRequest

        requests = [
            GenerationRequest(prompt_ids=list(w.prompt_ids), n=w.n, sampling=w.sampling) for w in works
        ]
        async with self.lock:
            version = self.version
            t0 = time.perf_counter()
            results = await asyncio.to_thread(self.engine.generate, requests)
            elapsed = time.perf_counter() - t0
        self.last_pass_s = elapsed
        groups, tokens = [], 0
        for work, completions in zip(works, results, strict=True):
            samples = [
                Sample(
                    response_ids=c.response_ids,
                    logprobs=c.logprobs,
                    text=c.text,
                    finish_reason=c.finish_reason if c.finish_reason in ("stop", "length") else "stop",
                )
                for c in completions
            ]
            tokens += sum(len(s.response_ids) for s in samples)
            groups.append(
                TrajectoryGroup(
                    work=work,
                    samples=samples,
                    policy_version=version,
                    replica_id=self.ctx.instance_id,
                    engine=self.engine.name,
                    timings={"generate_s": elapsed / len(works), "generated_at": time.time()},
                )
            )
        self.ctx.stats["tokens_per_s"] = tokens / elapsed if elapsed > 0 else 0.0
        return groups, tokens


async def admit(ctx: ServiceContext, deliveries: list[Work], limits: RequestLimits) -> list[Work]:
    """The deliveries the engine may take; the others are dead-lettered, each with its reason."""
    from rlbus.rollout.admission import rejection

    admitted = []
    for d in deliveries:
        reason = rejection(d.message, limits)
        if reason is None:
            admitted.append(d)
        else:
            await park(ctx, d, reason)
    return admitted


async def park(ctx: ServiceContext, delivery: Work, reason: str) -> None:
    """Dead-letter one work item the engine must not (or could not) take; the service goes on."""
    ctx.log.error("work item dead-lettered", prompt_id=delivery.message.prompt_id, reason=reason)
    await delivery.dead_letter(reason)


async def drop_orphans(ctx: ServiceContext, deliveries: list[Work]) -> list[Work]:
    """Work that needs a policy version above the learner's current one was dispatched by a learner attempt
    that died after pushing it (the learner only dispatches versions it delivered): the resumed learner
    dropped it and dispatched its data again, so waiting for that version would only hold this replica."""
    try:
        learner_version = await ctx.state.get_policy_version(default=-1)
    except Exception as exc:  # noqa: BLE001 - cannot tell: keep the work
        ctx.log.warning("cannot read the learner's policy version", error=str(exc))
        return deliveries
    if learner_version < 0:
        return deliveries
    kept = []
    for d in deliveries:
        if d.message.min_policy_version <= learner_version:
            kept.append(d)
            continue
        ctx.log.warning(
            "work of an earlier learner attempt dropped",
            prompt_id=d.message.prompt_id,
            needs=d.message.min_policy_version,
            learner=learner_version,
        )
        # parked, not terminated: were it ever a live attempt's prompt, the learner's ledger settles it from the
        # dead letter ('dead_lettered') instead of waiting for it to the end of the run
        await d.dead_letter(
            f"needs policy version {d.message.min_policy_version}, above the learner's {learner_version}: "
            "work of an earlier learner attempt"
        )
    return kept


async def hand_on(ctx: ServiceContext, delivery: Work, outcome: TrajectoryGroup | Exception) -> None:
    """Publish one prompt's trajectories, then ack its work; an item that alone broke the engine is parked."""
    from rlbus.bus import Stage

    if isinstance(outcome, Exception):
        await park(ctx, delivery, f"generation failed: {type(outcome).__name__}: {outcome}")
        return
    await ctx.bus.publish(Stage.TRAJECTORIES, outcome, msg_id=f"{outcome.work.prompt_id}:traj")
    await delivery.ack()
    ctx.stats["groups"] += 1


def say_at_start(ctx: ServiceContext, text: str) -> None:
    """A start-up step the operator waits on: in the log and on `rlbus up`'s console."""
    from rlbus.notices import post_notice

    ctx.log.info(text)
    post_notice(ctx.run_dir, "rollout", text)


async def serve_batch(ctx: ServiceContext, replica: Replica, deliveries: list[Work]) -> None:
    """Generate the admitted work once the weights are new enough (else hand it back), and hand each group on.
    While it is held, the heartbeat names it: if this process dies, the learner hands it back at once."""
    ctx.hold([d.ack_subject for d in deliveries])
    needed = max(d.message.min_policy_version for d in deliveries)
    try:
        if not await replica.wait_for_version(needed, ctx.cfg.weight_wait_s, deliveries):
            ctx.log.warning(
                "weights too old for this work; handing it back",
                have=replica.version,
                need=needed,
                prompt_ids=[d.message.prompt_id for d in deliveries],
            )
            for d in deliveries:
                await d.nak(delay=1.0)
            return
        async with kept_alive(deliveries, replica.keepalive_s):
            outcomes, tokens = await replica.generate_each([d.message for d in deliveries])
        # every group at once: their publishes and acks share the connection's writes and round trips
        async with asyncio.TaskGroup() as handing_on:
            for d, outcome in zip(deliveries, outcomes, strict=True):
                handing_on.create_task(hand_on(ctx, d, outcome))
    finally:
        ctx.hold([])
    ctx.stats["tokens"] += tokens
    ctx.log.info(
        "generated",
        version=replica.version,
        rows=sum(d.message.n for d in deliveries),  # against rollout.prompts_per_batch x n: a pass's fill
        prompt_ids=[d.message.prompt_id for d in deliveries],
    )


async def rollout_loop(ctx: ServiceContext) -> int:
    from rlbus.bus import Stage
    from rlbus.bus.hand_back import ROLLOUT_DURABLE
    from rlbus.model_source import resolve_model_path
    from rlbus.rollout.admission import limits_for
    from rlbus.rollout.batching import fetch_batch, linger_after
    from rlbus.rollout.engines.factory import build_engine
    from rlbus.weight_transport import device_place

    cfg = ctx.cfg
    model_path = resolve_model_path(cfg.model.path, cfg.model.use_shm)
    # the embedded engine's load and compile (20-40 s on a GPU) end with a stop; vLLM's and SGLang's own
    # processes must be shut down by the engine, so those finish starting first
    abandons = cfg.rollout.name == "hf"
    run = on_own_thread if abandons else asyncio.to_thread

    async def start() -> tuple[RolloutEngine, RequestLimits]:
        engine = await run(build_engine, cfg, model_path)
        await run(engine.warm_up, lambda text: say_at_start(ctx, text))
        return engine, await run(limits_for, cfg, model_path)

    try:
        engine, limits = await (unless_stopped(ctx.stop, start()) if abandons else start())
    except StoppedDuringStart:
        ctx.log.info("rollout stopped during start-up")
        return 0
    replica = Replica(ctx, engine)
    ctx.stats.update(
        weight_ranks=float(engine.weight_ranks),
        groups=0,
        tokens=0,
        ipc_capable=float(engine.supports_ipc),
        per_tensor_wire=float(engine.per_tensor_weights),
    )
    ctx.device = engine.weight_place or str(device_place(engine.weight_device))
    weights = asyncio.create_task(replica.weight_loop())
    await replica.answer_roll_calls()
    consumer = await ctx.bus.consumer(
        Stage.PROMPTS,
        durable=ROLLOUT_DURABLE,
        expected=PromptWork,
        ack_wait_s=held_work_ack_wait(cfg.bus.ack_wait_s),
        max_deliver=cfg.bus.max_deliver,
    )
    ctx.mark_ready()
    ctx.log.info("rollout ready", engine=engine.name)
    try:
        while not ctx.stop.is_set():
            if weights.done():
                exc = weights.exception()
                ctx.log.error("weight task ended; restarting it", error=str(exc) if exc else None)
                weights = asyncio.create_task(replica.weight_loop())
            linger_s = linger_after(replica.last_pass_s)
            deliveries = await fetch_batch(
                consumer, cfg.rollout.prompts_per_batch * cfg.rollout.n, cfg.rollout.n, 1.0, linger_s
            )
            again = [d for d in deliveries if d.num_delivered > 1]
            if again:  # a replica died (or timed out) holding this work, or it was nak'ed back
                ctx.log.info(
                    "work redelivered",
                    prompt_ids=[d.message.prompt_id for d in again],
                    deliveries=max(d.num_delivered for d in again),
                )
            deliveries = await admit(ctx, deliveries, limits)
            if not deliveries:
                continue
            deliveries = await drop_orphans(ctx, deliveries)
            if not deliveries:
                continue
            await serve_batch(ctx, replica, deliveries)
    finally:
        weights.cancel()
        await asyncio.to_thread(engine.close)
    return 0


def run_rollout(cfg: RlbusConfig, replica_id: str | None = None) -> int:
    rc = asyncio.run(run_service(cfg, "rollout", replica_id, rollout_loop))
    leave_if_start_abandoned(rc)
    return rc
