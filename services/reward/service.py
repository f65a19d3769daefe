"""The reward service: trajectories in, scored trajectories out (straight to `ready` when no ref is needed)."""

from __future__ import annotations

import asyncio
import time

from rlbus.config import RlbusConfig
from rlbus.messages import ReadyGroup, ScoredGroup, TrajectoryGroup
from rlbus.service import EXIT_REFUSED, ServiceContext, run_service

FETCH_BATCH = 16


def score_group(scorer, group: TrajectoryGroup, on_error: float) -> ScoredGroup:
    rewards, correct, errors = [], [], []
    for sample in group.samples:
        try:
            r, c = scorer.score(group.work.prompt_text, sample.text, dict(group.work.meta))
            rewards.append(float(r))
            correct.append(bool(c))
            errors.append(None)
        except Exception as exc:  # user code: anything can happen; record it and go on
            rewards.append(on_error)
            correct.append(False)
            errors.append(f"{type(exc).__name__}: {exc}"[:500])
    return ScoredGroup(
        trajectories=group, rewards=rewards, correct=correct, reward_errors=errors, reward_impl=scorer.name
    )


async def reward_loop(ctx: ServiceContext) -> int:
    from rlbus.bus import Stage
    from rlbus.reward.scorers import build_scorer

    cfg = ctx.cfg
    try:
        scorer = build_scorer(cfg.reward)
    except ValueError as exc:  # a reward that cannot load: one clear error, not a restart loop
        from rlbus.notices import post_notice

        ctx.log.error("reward implementation cannot load", reason=str(exc))
        post_notice(ctx.run_dir, "reward", f"refused: {exc}")
        return EXIT_REFUSED
    out_stage = Stage.SCORED if cfg.needs_ref else Stage.READY
    consumer = await ctx.bus.consumer(
        Stage.TRAJECTORIES,
        durable="reward",
        expected=TrajectoryGroup,
        ack_wait_s=cfg.bus.ack_wait_s,
        max_deliver=cfg.bus.max_deliver,
    )
    ctx.status = "ready"
    ctx.stats.update(groups=0, samples=0, errors=0)
    while not ctx.stop.is_set():
        deliveries = await consumer.fetch(batch=FETCH_BATCH, timeout=1.0)
        for d in deliveries:
            t0 = time.perf_counter()
            scored = await asyncio.to_thread(score_group, scorer, d.message, cfg.reward.on_error_score)
            n_err = sum(e is not None for e in scored.reward_errors)
            if n_err:
                ctx.log.warning(
                    "reward function raised",
                    errors=n_err,
                    first=next(e for e in scored.reward_errors if e),
                    prompt_id=scored.trajectories.work.prompt_id,
                )
            scored.trajectories.timings["reward_s"] = time.perf_counter() - t0
            out = scored if out_stage == Stage.SCORED else ReadyGroup(scored=scored)
            await ctx.bus.publish(out_stage, out, msg_id=f"{scored.trajectories.work.prompt_id}:scored")
            await d.ack()
            ctx.stats["groups"] += 1
            ctx.stats["samples"] += len(scored.rewards)
            ctx.stats["errors"] += n_err
        ctx.stats["dead_letters"] = float(getattr(consumer, "dead_letters", 0))
    if hasattr(scorer, "close"):
        scorer.close()
    return 0


def run_reward(cfg: RlbusConfig, instance_id: str | None = None) -> int:
    return asyncio.run(run_service(cfg, "reward", instance_id, reward_loop))
