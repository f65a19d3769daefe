"""A learner start after another attempt of the same run: what the bus keeps, what it forgets, and the
checkpoint state restored into the learner."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlbus.bus import Stage
from rlbus.bus.state import ANNOUNCE_KEY
from rlbus.learner.checkpoint import load_checkpoint, rewind_metrics
from rlbus.learner.dispatch import Ledger
from rlbus.learner.memory_checkpoint import MemoryCheckpoint, load_memory_checkpoint
from rlbus.messages import WeightAnnouncement, decode
from rlbus.service import ServiceContext

ATTEMPTS_KEY = "learner_attempts"  # KV fact: learner starts of this run id (kept across the fresh purge)
LEARNER_DURABLE = "learner"  # the learner's consumer of ready groups


@dataclass(frozen=True)
class Attempt:
    """What an earlier attempt of this run left behind."""

    number: int  # learner starts of this run id before this one
    replicas_may_differ: bool  # an earlier attempt pushed weights: replicas may hold them
    stale_epoch: int  # weight-group epoch of the crashed attempt's last announcement


async def forget_announcement(ctx: ServiceContext) -> int:
    """The crashed attempt's weight announcement names a group that is gone: a replica starting now would
    wait on it for its whole timeout. Delete it, and return its epoch (ours must be newer)."""
    epoch = 0
    with contextlib.suppress(Exception):
        raw = await ctx.state.get_announcement()
        if raw:
            epoch = decode(raw, WeightAnnouncement).epoch
        await ctx.state.kv.purge(ANNOUNCE_KEY)
    return epoch


async def prepare_bus(ctx: ServiceContext, fresh: bool) -> Attempt:
    """A fresh start empties the run's streams; a resume keeps them (replica heartbeats, weight
    announcements, the DLQ, results in flight) but drops the crashed attempt's queued prompt work: all of
    it is superseded, and it may ask for policy versions the resumed learner has not reached."""
    state = ctx.state
    attempt = Attempt(
        number=int(await state.get_json(ATTEMPTS_KEY, 0) or 0),
        replicas_may_differ=int(await state.get_policy_version(0)) > 0,
        stale_epoch=await forget_announcement(ctx),
    )
    if fresh:
        await ctx.bus.purge_run()  # a fresh run never trains on a previous run's leftovers
    else:
        for stream in ctx.bus.names.streams(Stage.PROMPTS):
            with contextlib.suppress(Exception):
                await ctx.bus.js.purge_stream(stream)
        # Ready groups the dead attempt fetched and never acked would stay invisible for the consumer's
        # whole ack wait (600 s): dropping the durable hands them to our new consumer at once (the
        # work-queue stream keeps every un-acked message), where they are counted as leftovers.
        with contextlib.suppress(Exception):
            await ctx.bus.delete_consumer(Stage.READY, LEARNER_DURABLE)
    await state.put_json(ATTEMPTS_KEY, attempt.number + 1)  # prompt ids of the next start differ
    return attempt


@dataclass
class Restored:
    """The run state a checkpoint gives back to the learner."""

    step: int
    version: int
    ledger: Ledger
    redispatch: list  # prompts the dead attempt had in flight: dispatched again


async def restore(trainer: Any, loader: Any, source: Path | MemoryCheckpoint, run_dir: Path) -> Restored:
    """Model and optimiser into `trainer`, the data position into `loader`; the rest is returned. The work
    the dead attempt had in flight is settled as resumed and handed back for re-dispatch."""
    if isinstance(source, MemoryCheckpoint):  # one learner process wrote it: no other rank to lead
        extra = await asyncio.to_thread(load_memory_checkpoint, source, trainer)
    else:
        trainer.par.lead_call("load_checkpoint", path=str(source))  # FSDP ranks > 0 load alongside
        extra = await asyncio.to_thread(load_checkpoint, source, trainer)
    loader.load_state_dict(extra["loader"])
    ledger = Ledger.from_dict(extra["ledger"])
    restored = Restored(int(extra["step"]), int(extra["policy_version"]), ledger, ledger.settle_for_resume())
    rewind_metrics(run_dir, restored.step)
    ledger.save(run_dir / "ledger.json")
    return restored
