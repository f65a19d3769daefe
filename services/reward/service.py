"""The reward service: trajectories in, scored trajectories out (straight to `ready` when no ref is needed)."""

from __future__ import annotations

import asyncio
import time

from rlbus.bus.keepalive import held_work_ack_wait, keepalive_every, kept_alive
from rlbus.config import RlbusConfig
from rlbus.messages import ReadyGroup, ScoredGroup, TrajectoryGroup
from rlbus.reward.sandbox import error_text
from rlbus.service import EXIT_REFUSED, ServiceContext, run_service

FETCH_BATCH = 16
CHUNK_SAMPLES = 16  # a user function's round trip to its sandbox takes whole groups up to this many samples


class RewardBroken(RuntimeError):
    """`reward.max_failed_groups` groups in a row had every reward call fail."""


class FailureStreak:
    """Counts groups in a row whose every sample's reward call failed; says when there were too many."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.count = 0
        self.first_error = ""

    def see(self, scored: ScoredGroup) -> bool:
        """Count one scored group; True when the streak reached the limit."""
        errors = scored.reward_errors
        if errors and all(e is not None for e in errors):
            if self.count == 0:
                self.first_error = str(errors[0])
            self.count += 1
        else:
            self.count = 0
        return self.limit > 0 and self.count >= self.limit


def score_groups(scorer, groups: list[TrajectoryGroup], on_error: float) -> list[ScoredGroup]:
    """Every sample of `groups`: one call for a batched scorer (a failure marks the whole call's samples), the
    scorer's own outcome per sample where it scores many at once (`score_each`: a user function's one round
    trip to its sandbox), else one call per sample (a failure marks that sample). Failed samples score
    `on_error`."""
    items = [(g.work.prompt_text, s.text, dict(g.work.meta)) for g in groups for s in g.samples]
    results: list[tuple[float, bool] | str] = []
    if getattr(scorer, "batched", False) and items:
        try:
            results = list(scorer.score_batch(items))
        except Exception as exc:  # user code / model: anything can happen; record it and go on
            results = [error_text(exc)] * len(items)
    elif hasattr(scorer, "score_each") and items:
        results = list(scorer.score_each(items))
    else:
        for prompt, response, meta in items:
            try:
                results.append(scorer.score(prompt, response, meta))
            except Exception as exc:
                results.append(error_text(exc))
    out, i = [], 0
    for g in groups:
        rewards, correct, errors = [], [], []
        for res in results[i : i + len(g.samples)]:
            failed = isinstance(res, str)
            rewards.append(on_error if failed else float(res[0]))
            correct.append(False if failed else bool(res[1]))
            errors.append(res if failed else None)
        i += len(g.samples)
        out.append(
            ScoredGroup(
                trajectories=g,
                rewards=rewards,
                correct=correct,
                reward_errors=errors,
                reward_impl=scorer.name,
            )
        )
    return out


def score_group(scorer, group: TrajectoryGroup, on_error: float) -> ScoredGroup:
    return score_groups(scorer, [group], on_error)[0]


async def _publish_scored(
    ctx: ServiceContext, delivery, scored: ScoredGroup, seconds: float, out_stage
) -> None:
    from rlbus.bus import Stage

    n_err = sum(e is not None for e in scored.reward_errors)
    if n_err:
        ctx.log.warning(
            "reward function raised",
            errors=n_err,
            first=next(e for e in scored.reward_errors if e),
            prompt_id=scored.trajectories.work.prompt_id,
        )
    scored.trajectories.timings["reward_s"] = seconds
    out = scored if out_stage == Stage.SCORED else ReadyGroup(scored=scored)
    result = await ctx.bus.publish(out_stage, out, msg_id=f"{scored.trajectories.work.prompt_id}:scored")
    await delivery.ack()
    ctx.log.info(
        "scored",
        prompt_id=scored.trajectories.work.prompt_id,
        replica=scored.trajectories.replica_id,
        duplicate=result.duplicate,
    )
    ctx.stats["groups"] += 1
    ctx.stats["samples"] += len(scored.rewards)
    ctx.stats["errors"] += n_err
    # a group already stored under this msg id (a redelivery's second scoring, or another publisher's): ours
    # was dropped by JetStream's dedup; counted so `rlbus status` shows it
    ctx.stats["duplicate_publishes"] = ctx.stats.get("duplicate_publishes", 0.0) + float(result.duplicate)


async def reward_loop(ctx: ServiceContext) -> int:
    from rlbus.bus import Stage
    from rlbus.notices import post_notice
    from rlbus.reward.scorers import build_scorer

    cfg = ctx.cfg
    try:
        scorer = build_scorer(cfg.reward, cfg.reward_model, cfg.model.trust_remote_code)
        problem = await asyncio.to_thread(scorer.check) if hasattr(scorer, "check") else None
    except ValueError as exc:  # a reward that cannot load: one clear error, not a restart loop
        ctx.log.error("reward implementation cannot load", reason=str(exc))
        post_notice(ctx.run_dir, "reward", f"refused: {exc}")
        return EXIT_REFUSED
    if problem:
        ctx.log.warning("reward function raised on a built-in sample; serving anyway", error=problem)
        post_notice(ctx.run_dir, "reward", f"reward.function raised on a built-in sample: {problem}")
    out_stage = Stage.SCORED if cfg.needs_ref else Stage.READY
    consumer = await ctx.bus.consumer(
        Stage.TRAJECTORIES,
        durable="reward",
        expected=TrajectoryGroup,
        ack_wait_s=held_work_ack_wait(cfg.bus.ack_wait_s),
        max_deliver=cfg.bus.max_deliver,
    )
    keepalive_s = keepalive_every(cfg.bus.ack_wait_s)
    ctx.mark_ready()
    ctx.stats.update(groups=0, samples=0, errors=0)
    streak = FailureStreak(cfg.reward.max_failed_groups)
    try:
        while not ctx.stop.is_set():
            deliveries = await consumer.fetch(batch=FETCH_BATCH, timeout=1.0)
            async with kept_alive(deliveries, keepalive_s):  # the fetch's later items wait their turn
                await _score_and_publish(ctx, scorer, deliveries, out_stage, streak)
            ctx.stats["dead_letters"] = float(getattr(consumer, "dead_letters", 0))
    except RewardBroken as exc:
        ctx.log.error("reward keeps failing; stopping the run", reason=str(exc))
        post_notice(ctx.run_dir, "reward", f"stopped: {exc}")
        return EXIT_REFUSED
    finally:
        if hasattr(scorer, "close"):
            scorer.close()
    return 0


def chunk_groups(sizes: list[int], most: int) -> list[range]:
    """Consecutive groups (of `sizes` samples) in chunks of up to `most` samples, at least one group each: a
    user function's round trip takes a chunk, so an evaluation's one-sample groups share trips (256 of them
    took 256 trips, as long as generating them on the CPU box) while a slow function still holds few acks."""
    chunks: list[range] = []
    start, samples = 0, 0
    for i, size in enumerate(sizes):
        if i > start and samples + size > most:
            chunks.append(range(start, i))
            start, samples = i, 0
        samples += size
    if sizes:
        chunks.append(range(start, len(sizes)))
    return chunks


async def _score_and_publish(
    ctx: ServiceContext, scorer, deliveries: list, out_stage, streak: FailureStreak | None = None
) -> None:
    """A batched scorer (reward model, batch manager) takes the whole fetch in one call, and a fast one (the
    built-in verifiers) scores it in one thread hand-off (each hand-off wakes the loop: ~0.3 ms of CPU on
    the 2-core box); any other scores a few groups at a time (`chunk_groups`), so a slow function holds few
    acks. A scored group is published and acked while the next chunk is scored: those round trips overlap."""
    whole_fetch = (getattr(scorer, "batched", False) or getattr(scorer, "fast", False)) and deliveries
    chunks = (
        [deliveries]
        if whole_fetch
        else [
            deliveries[r.start : r.stop]
            for r in chunk_groups([len(d.message.samples) for d in deliveries], CHUNK_SAMPLES)
        ]
    )
    broken: RewardBroken | None = None
    async with asyncio.TaskGroup() as handing_on:
        for c, chunk in enumerate(chunks):
            t0 = time.perf_counter()
            scored_groups = await asyncio.to_thread(
                score_groups, scorer, [d.message for d in chunk], ctx.cfg.reward.on_error_score
            )
            seconds = (time.perf_counter() - t0) / len(chunk)
            for i, (d, scored) in enumerate(zip(chunk, scored_groups, strict=True)):
                if streak is not None and streak.see(scored):
                    broken = RewardBroken(
                        f"{streak.count} groups in a row had every reward call fail "
                        f"(reward.max_failed_groups={streak.limit}); first error: {streak.first_error}; "
                        f"fix reward.function ({getattr(scorer, 'name', '?')}) and start the reward service again"
                    )
                    # this group and the unscored rest go back, for the reward service that replaces us
                    for held in [*chunk[i:], *(d for later in chunks[c + 1 :] for d in later)]:
                        await held.nak()
                    break
                handing_on.create_task(_publish_scored(ctx, d, scored, seconds, out_stage))
            if broken is not None:
                break
    if broken is not None:
        raise broken


def run_reward(cfg: RlbusConfig, instance_id: str | None = None) -> int:
    return asyncio.run(run_service(cfg, "reward", instance_id, reward_loop))
