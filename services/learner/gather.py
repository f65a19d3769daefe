"""Ready groups into batches: each group routed (validation answer, batch member, overflow or dropped with a
reason), the wait kept alive and explained, and a stall named when nothing arrives."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterator
from enum import Enum
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from rlbus.bus.fan_in import WorkConsumer
from rlbus.config import RlbusConfig
from rlbus.learner.admission import ReadyLimits, rejection
from rlbus.learner.dispatch import REFUSED, Dispatcher, Ledger
from rlbus.learner.weight_push import WeightPusher
from rlbus.messages import ReadyGroup
from rlbus.notices import post_notice
from rlbus.service import ServiceContext

WAIT_LOG_EVERY_S = 10.0
KEEPALIVE_EVERY_S = 10.0
PUSH_RETRY_POLL_S = 0.25  # how soon a failed weight push is tried again while no data arrives
RECLAIM_AFTER_S = (
    5.0  # at the run's end, this long with nothing arriving before the ready consumer is renewed
)


class LearnerStalled(RuntimeError):
    """No ready group arrived for `trainer.batch_timeout_s`."""


class Route(Enum):
    """Where one ready group goes. Values that are drop reasons are the ledger's own words."""

    VALIDATION = "validation"
    LEFTOVER = "leftover"  # work of an earlier learner attempt: superseded, never trained
    DUPLICATE = "duplicate"  # a redelivery raced its ack
    FUTURE = "future_version"  # made with weights of a crashed attempt newer than the checkpoint
    STALE = "stale"
    ZERO_VARIANCE = "zero_variance"
    OVERFLOW = "overflow"  # the batch is full and waits only for validation: kept for the next one
    BATCH = "batch"


DROPPED = (Route.FUTURE, Route.STALE, Route.ZERO_VARIANCE)


def route(
    group: ReadyGroup,
    *,
    version: int,
    known: bool,
    settled_or_batched: bool,
    async_level: int,
    dynamic_sampling: bool,
    batch_full: bool,
) -> Route:
    """Pure routing of one ready group; `known`: dispatched by this attempt; `settled_or_batched`: already
    trained, dropped or in the batch being gathered."""
    if group.scored.trajectories.work.split == "val":
        return Route.VALIDATION
    lag = version - group.scored.trajectories.policy_version
    if not known:
        return Route.LEFTOVER
    if settled_or_batched:
        return Route.DUPLICATE
    if lag < 0:
        return Route.FUTURE
    if lag > async_level:
        return Route.STALE
    if dynamic_sampling and len(set(group.scored.rewards)) == 1:
        return Route.ZERO_VARIANCE
    return Route.OVERFLOW if batch_full else Route.BATCH


def validation_metrics(results: list[tuple[float, bool, int, str]]) -> dict[str, float]:
    """Held-out scores from (reward, correct, policy version that answered, data source) per validation
    prompt; verl's `val-core/<data_source>/reward/mean@1` per source beside ours.

    Validation work asks for the learner's version at dispatch and the learner waits for its answers
    before the next push (training beside it), so every answer comes from exactly those weights; the record
    says which answered."""
    if not results:
        return {}
    versions = [v for _, _, v, _ in results]
    out = {
        "val/accuracy": float(np.mean([c for _, c, _, _ in results])),
        "val/reward_mean": float(np.mean([r for r, _, _, _ in results])),
        "val/version": float(min(versions)),
        "val/version_max": float(max(versions)),
        "val/prompts": float(len(versions)),
    }
    for source in sorted({s for _, _, _, s in results}):
        rewards = [r for r, _, _, s in results if s == source]
        out[f"val-core/{source}/reward/mean@1"] = float(np.mean(rewards))
    return out


class GatherHost(Protocol):
    """What the gatherer reads from (and asks of) the learner it gathers for."""

    ctx: ServiceContext
    cfg: RlbusConfig
    run_dir: Path
    version: int
    ledger: Ledger
    dispatcher: Dispatcher
    pusher: WeightPusher
    forced_push_at: float
    limits: ReadyLimits
    val_records: list

    def named_weights(self) -> Iterator[tuple[str, Any]]: ...

    async def push_current(self, reason: str = "start") -> None: ...

    async def settle(self, delivery: Any, reason: str | None, step: int | None = None) -> None: ...


class Gatherer:
    """Collects one batch of ready groups for the learner, and the validation answers that come with it."""

    def __init__(self, learner: GatherHost, consumer: WorkConsumer[ReadyGroup]) -> None:
        self.learner = learner
        self.consumer = consumer
        self.overflow: list = []  # ready groups received while a full batch waited for validation
        self.val_pending: dict[str, int] = {}  # validation prompt id -> record index
        self.val_step = 0  # the step the pending validation was started at
        self.val_again = 0  # validation prompts dispatched again (their answer was refused)
        self.val_results: list[tuple[float, bool, int, str]] = []
        self.weights_behind = False  # a group came from weights this learner never made: push ours
        self._refused_said: set[str] = set()
        self._dispatching: asyncio.Task | None = None  # the top-up in flight (see _dispatch)

    def validation_metrics(self) -> dict[str, float]:
        return {} if self.val_pending else validation_metrics(self.val_results)

    async def consider(self, d: Any, batch: list, need: int) -> None:
        learner = self.learner
        group: ReadyGroup = d.message
        pid = group.scored.trajectories.work.prompt_id
        ledger = learner.ledger
        known = pid in ledger.dispatched and ledger.dropped.get(pid) != "resumed"
        settled_or_batched = ledger.is_settled(pid) or any(
            pid == b.message.scored.trajectories.work.prompt_id for b in batch
        )
        expected_index = self.val_pending.get(pid) if group.scored.trajectories.work.split == "val" else None
        if expected_index is None and known and not settled_or_batched:
            expected_index = ledger.dispatched[pid]
        if expected_index is not None:  # this group would be used: check it first
            reason = rejection(group, learner.limits, expected_index)
            if reason is not None:
                await self._refuse(d, pid, reason)
                return
        where = route(
            group,
            version=learner.version,
            known=known,
            settled_or_batched=settled_or_batched,
            async_level=learner.cfg.trainer.async_level,
            dynamic_sampling=learner.cfg.algorithm.dynamic_sampling,
            batch_full=len(batch) >= need,
        )
        if where is Route.VALIDATION:
            if self.val_pending.pop(pid, None) is not None:
                scored = group.scored
                work = scored.trajectories.work
                source = str(work.meta.get("data_source") or work.meta.get("task") or "unknown")
                self.val_results.append(
                    (scored.rewards[0], scored.correct[0], scored.trajectories.policy_version, source)
                )
            await d.ack()
        elif where in (Route.LEFTOVER, Route.DUPLICATE):
            if where is Route.LEFTOVER:
                ledger.leftovers += 1
            else:
                ledger.duplicates += 1
            await d.ack()
        elif where in DROPPED:
            await learner.settle(d, where.value)
            self.weights_behind |= where is Route.FUTURE
        elif where is Route.OVERFLOW:
            self.overflow.append(d)
        else:
            batch.append(d)

    async def _refuse(self, d: Any, pid: str, reason: str) -> None:
        """A group that failed admission: dead-lettered alone with `reason`, its prompt dispatched again
        under a new id (the honest group, if it still comes, meets a settled id and is acked unused)."""
        learner = self.learner
        if pid in self.val_pending:
            index = self.val_pending.pop(pid)
            self.val_again += 1
            again = await learner.dispatcher.dispatch_validation_again(
                learner.val_records, index, learner.version, self.val_step, self.val_again
            )
            self.val_pending[again] = index
        else:
            learner.ledger.dropped[pid] = REFUSED  # before the dead letter: its echo finds it settled
            learner.dispatcher.dispatch_again(learner.ledger.dispatched[pid])
        learner.ctx.log.warning(
            "ready group refused; its prompt goes out again", prompt_id=pid, reason=reason
        )
        await d.dead_letter(f"refused by the learner: {reason}")

    async def gather(self, step: int, need: int) -> list:
        """Ready groups for one batch: fresh enough, not duplicates, (DAPO) not all-equal when asked.

        Validation groups that arrive meanwhile are scored into `val_results`; the batch does not wait for
        the rest of them (`finish_validation` does).
        """
        return await self._collect(step, need, validation=False)

    async def finish_validation(self, step: int) -> None:
        """Until every validation answer started for `step` is in; training groups that come meanwhile are
        held for the next batch. The learner calls it before it pushes newer weights: the replicas answer
        the evaluation with the version it is labelled with, while the learner trains beside it."""
        await self._collect(step, 0, validation=True)

    async def _collect(self, step: int, need: int, validation: bool) -> list:
        learner = self.learner
        batch: list = []
        started = last_log = last_keepalive = last_progress = time.monotonic()
        while len(batch) < need or (validation and self.val_pending):
            if learner.ctx.stop.is_set():
                raise asyncio.CancelledError
            delivered = learner.pusher.pushed_version >= learner.version
            if need and delivered:  # never work for weights no replica has
                await self._dispatch(learner.version, step, len(batch))
            held, self.overflow = self.overflow, []
            for d in held:
                await self.consider(d, batch, need)
            # a failed push is retried between fetches: look again soon, the replicas are idle meanwhile
            deliveries = await self.consumer.fetch(
                batch=max(1, need - len(batch) + len(self.val_pending)),
                timeout=1.0 if delivered else PUSH_RETRY_POLL_S,
            )
            now = time.monotonic()
            for d in deliveries:
                await self.consider(d, batch, need)
                last_progress = now
            if not deliveries:
                await learner.pusher.maintain(learner.named_weights, learner.version)
            if self.weights_behind and now - learner.forced_push_at > 5.0:
                self.weights_behind = False
                await learner.push_current("a replica generated with weights newer than ours")
            if now - last_keepalive > KEEPALIVE_EVERY_S:
                for d in batch + self.overflow:
                    await d.in_progress()
                last_keepalive = now
            if now - last_log > WAIT_LOG_EVERY_S:
                await self._log_wait(step, len(batch), need, now - started)
                last_log = now
            if now - last_progress > learner.cfg.trainer.batch_timeout_s:
                raise LearnerStalled(self._stall_reason(step, len(batch), need))
        await self._dispatched()
        return batch

    async def drain(
        self,
        timeout_s: float,
        reopen: Callable[[WorkConsumer[ReadyGroup]], Awaitable[WorkConsumer[ReadyGroup]]],
    ) -> None:
        """After the last step: settle what is still in flight as 'run_finished', for at most `timeout_s`.
        Once nothing has come for RECLAIM_AFTER_S, the consumer is made afresh by `reopen` (once): a delivery
        a NATS crash or a lost connection dropped on its way here stays pending on the server until the
        learner's 600 s ack wait ends; a new consumer is handed it at once."""
        ledger = self.learner.ledger
        deadline = time.monotonic() + timeout_s
        held, self.overflow = self.overflow, []  # set aside while the final validation ran
        await self._settle_after_the_end(held)
        quiet_since, reopened = time.monotonic(), False
        while ledger.in_flight > 0 and time.monotonic() < deadline:
            got = await self.consumer.fetch(batch=64, timeout=1.0)
            await self._settle_after_the_end(got)
            if got:
                quiet_since = time.monotonic()
            elif not reopened and time.monotonic() - quiet_since > RECLAIM_AFTER_S:
                reopened = True
                self.learner.ctx.log.info("nothing arrives at the end: the ready consumer made afresh")
                self.consumer = await reopen(self.consumer)

    async def _settle_after_the_end(self, deliveries: list) -> None:
        ledger = self.learner.ledger
        for d in deliveries:
            pid = d.message.scored.trajectories.work.prompt_id
            if pid in ledger.dispatched and not ledger.is_settled(pid):
                await self.learner.settle(d, "run_finished")
            else:
                await d.ack()

    async def _dispatch(self, version: int, step: int, have: int) -> None:
        """Top up the work in flight beside the fetch, not before it: the publishes' round trips overlap
        the wait for ready groups. One top-up at a time (the ledger counts a prompt once it is stored)."""
        if self._dispatching is not None:
            if not self._dispatching.done():
                return
            await self._dispatched()
        self._dispatching = asyncio.create_task(self.learner.dispatcher.top_up(version, step, have))

    async def _dispatched(self) -> None:
        """Wait for the top-up in flight; its failure is raised here, as if it had been awaited in place."""
        task, self._dispatching = self._dispatching, None
        if task is not None:
            await task

    def _stall_reason(self, step: int, have: int, need: int) -> str:
        learner = self.learner
        why = (
            f"replicas may be waiting for weights: {learner.pusher.status}"
            if learner.pusher.status
            else "are the rollout and reward services running? see `rlbus status`"
        )
        return (
            f"no ready trajectories for {learner.cfg.trainer.batch_timeout_s:.0f}s at step {step} "
            f"(have {have}/{need}, {learner.ledger.in_flight} prompts in flight); {why}"
        )

    async def _log_wait(self, step: int, have: int, need: int, waited_s: float) -> None:
        """The log says what the learner waits for; the console hears it when the weight push is the
        reason (or a replica was refused)."""
        learner = self.learner
        pusher = learner.pusher
        learner.ctx.log.info(
            "waiting for ready trajectories",
            step=step,
            have=have,
            need=need,
            in_flight=learner.ledger.in_flight,
            replicas=sorted(await pusher.live_replicas()),
            validation_pending=len(self.val_pending),
            waited_s=round(waited_s),
            weight_push=pusher.status or "ok",
        )
        for rid, why in list(pusher.refused.items()):
            if rid not in self._refused_said:
                self._refused_said.add(rid)
                post_notice(learner.run_dir, "learner", f"replica {rid} refused: {why}")
        if pusher.status:
            post_notice(
                learner.run_dir, "learner", f"step {step} waits ({have}/{need} groups): {pusher.status}"
            )
