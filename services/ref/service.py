"""The ref service: reference-policy log-probs for every sample, from the frozen initial weights."""

from __future__ import annotations

import asyncio
import time

from rlbus.config import RlbusConfig
from rlbus.messages import ReadyGroup, ScoredGroup
from rlbus.service import ServiceContext, run_service

FETCH_BATCH = 8


class ReferenceModel:
    """The frozen model; one forward per micro-batch, same log-prob code as the learner."""

    def __init__(self, cfg: RlbusConfig) -> None:
        from rlbus.model_source import resolve_model_path
        from rlbus.modeling import load_causal_lm, load_tokenizer, pick_device

        path = cfg.ref.model_path or resolve_model_path(cfg.model.path, cfg.model.use_shm)
        self.device = pick_device(cfg.ref.device or cfg.trainer.device)
        self.model = load_causal_lm(path, cfg.model.dtype, self.device, trainable=False)
        self.pad_id = int(load_tokenizer(path).pad_token_id)
        self.micro_batch_size = cfg.ref.micro_batch_size

    def logprobs(self, groups: list[ScoredGroup]) -> list[ReadyGroup]:
        from rlbus.modeling import response_logprobs

        prompts, responses, temps = [], [], []
        for g in groups:
            work = g.trajectories.work
            for s in g.trajectories.samples:
                prompts.append(list(work.prompt_ids))
                responses.append(list(s.response_ids))
            temps.append(work.sampling.temperature)
        # one temperature per call: groups of a run share their sampling temperature
        lps = response_logprobs(
            self.model, prompts, responses, self.pad_id, temps[0] if temps else 1.0, self.micro_batch_size
        )
        out, i = [], 0
        for g in groups:
            n = len(g.trajectories.samples)
            out.append(ReadyGroup(scored=g, ref_logprobs=lps[i : i + n]))
            i += n
        return out


async def ref_loop(ctx: ServiceContext) -> int:
    from rlbus.bus import Stage

    ref = await asyncio.to_thread(ReferenceModel, ctx.cfg)
    consumer = await ctx.bus.consumer(
        Stage.SCORED,
        durable="ref",
        expected=ScoredGroup,
        ack_wait_s=ctx.cfg.bus.ack_wait_s,
        max_deliver=ctx.cfg.bus.max_deliver,
    )
    ctx.mark_ready()
    ctx.stats.update(groups=0)
    while not ctx.stop.is_set():
        deliveries = await consumer.fetch(batch=FETCH_BATCH, timeout=1.0)
        if not deliveries:
            continue
        t0 = time.perf_counter()
        ready = await asyncio.to_thread(ref.logprobs, [d.message for d in deliveries])
        elapsed = time.perf_counter() - t0
        for d, r in zip(deliveries, ready, strict=True):
            r.scored.trajectories.timings["ref_s"] = elapsed / len(ready)
            await ctx.bus.publish(Stage.READY, r, msg_id=f"{r.scored.trajectories.work.prompt_id}:ready")
            await d.ack()
        ctx.stats["groups"] += len(ready)
    return 0


def run_ref(cfg: RlbusConfig, instance_id: str | None = None) -> int:
    return asyncio.run(run_service(cfg, "ref", instance_id, ref_loop))
