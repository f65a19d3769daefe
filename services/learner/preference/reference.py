"""Reference log-probs, computed once up front for every sequence the run will score (locally or by the ref service)."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import numpy as np
import torch

from rlbus.config import RlbusConfig
from rlbus.learner.preference.data import PreferenceData, Seq
from rlbus.learner.preference.losses import uses_average
from rlbus.modeling import load_causal_lm, load_tokenizer, response_logprobs

# --------------------------------------------------------------------------------------------------
# reference log-probs


def local_ref_logps(cfg: RlbusConfig, seqs: Sequence[Seq], device: torch.device) -> list[np.ndarray]:
    """Token log-probs of every sequence under the frozen reference, loaded here and dropped afterwards."""
    from rlbus.model_source import resolve_model_path

    path = cfg.ref.model_path or resolve_model_path(cfg.model.path, cfg.model.use_shm)
    ref = load_causal_lm(
        path, cfg.model.dtype, device, trainable=False, trust_remote_code=cfg.model.trust_remote_code
    )
    pad_id = int(load_tokenizer(path, cfg.model.trust_remote_code).pad_token_id)
    try:
        return response_logprobs(
            ref, [s[0] for s in seqs], [s[1] for s in seqs], pad_id, 1.0, cfg.ref.micro_batch_size
        )
    finally:
        del ref


def _groups_by_prompt(seqs: Sequence[Seq]) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, indices of its sequences): one bus message per distinct prompt, as a rollout group."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, (prompt, _) in enumerate(seqs):
        groups.setdefault(tuple(prompt), []).append(i)
    return [(list(p), idx) for p, idx in groups.items()]


async def _service_ref_logps_async(cfg: RlbusConfig, seqs: Sequence[Seq], log: Callable[[str], None]) -> list:
    """Publish every sequence as a ScoredGroup and collect the ref service's ReadyGroups.

    The run has no rollout or reward stage, so the groups enter the pipeline where the ref service reads
    (SCORED); answers come back on READY under the learner's durable, which this process stands in for.
    A nonce in every prompt id keeps a rerun under the same run id clear of JetStream's dedup window.
    """
    from rlbus.bus import Bus, Stage, resolve_bus_url
    from rlbus.messages import PromptWork, ReadyGroup, Sample, SamplingParams, ScoredGroup, TrajectoryGroup

    url, server = resolve_bus_url(cfg.bus, Path(cfg.run.dir) / cfg.run.id)
    if server is not None:
        server.stop()
        raise ValueError(
            "preference.ref_source=service needs a NATS server with a ref service on it "
            "(set bus.url and run `rlbus ref` with the same config), or use ref_source=local"
        )
    nonce = uuid.uuid4().hex[:10]
    groups = _groups_by_prompt(seqs)
    out: list[np.ndarray | None] = [None] * len(seqs)
    pending: dict[str, list[int]] = {}
    bus = await Bus.open(cfg, url, name=f"preference-{nonce}")
    try:
        consumer = await bus.consumer(Stage.READY, durable="learner", expected=ReadyGroup)
        for g, (prompt, idx) in enumerate(groups):
            pid = f"pref-{nonce}-{g}"
            work = PromptWork(
                run_id=cfg.run.id,
                prompt_id=pid,
                index=g,
                step=0,
                min_policy_version=0,
                prompt_ids=prompt,
                n=len(idx),
                sampling=SamplingParams(temperature=1.0),
            )
            samples = [
                Sample(response_ids=seqs[i][1], logprobs=np.zeros(len(seqs[i][1]), np.float32)) for i in idx
            ]
            traj = TrajectoryGroup(
                work=work, samples=samples, policy_version=0, replica_id="preference", engine="offline"
            )
            scored = ScoredGroup(trajectories=traj, rewards=[0.0] * len(idx), correct=[False] * len(idx))
            await bus.publish(Stage.SCORED, scored, msg_id=f"{pid}:scored")
            pending[pid] = idx
        log(f"sent {len(groups)} groups ({len(seqs)} sequences) to the ref service on run {cfg.run.id}")
        deadline = time.monotonic() + cfg.preference.ref_timeout_s
        while pending:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"the ref service answered {len(groups) - len(pending)}/{len(groups)} groups "
                    f"in {cfg.preference.ref_timeout_s:.0f}s; is `rlbus ref` running on run "
                    f"{cfg.run.id}?"
                )
            for d in await consumer.fetch(batch=64, timeout=2.0):
                ready = cast(ReadyGroup, d.message)  # the consumer validated it as one
                pid = ready.scored.trajectories.work.prompt_id
                if pid not in pending:
                    await d.ack()  # an answer to an earlier attempt of this run: nobody else wants it
                    continue
                for i, lp in zip(pending.pop(pid), ready.ref_logprobs or [], strict=True):
                    out[i] = np.asarray(lp, dtype=np.float32)
                await d.ack()
        await consumer.close()
    finally:
        await bus.close()
    return out


def ref_logps(
    cfg: RlbusConfig, seqs: Sequence[Seq], device: torch.device, log: Callable[[str], None]
) -> list[np.ndarray]:
    """Per-sequence reference token log-probs from the configured source."""
    if not seqs:
        return []
    if cfg.preference.ref_source == "service":
        return asyncio.run(_service_ref_logps_async(cfg, seqs, log))
    return local_ref_logps(cfg, seqs, device)


def reduce_logps(arrays: Sequence[np.ndarray], average: bool) -> torch.Tensor:
    """Token log-probs -> one number per sequence (sum, or mean over tokens), the reduction of `sequence_logps`."""
    values = [float(a.mean()) if average and len(a) else float(a.sum()) for a in arrays]
    return torch.tensor(values, dtype=torch.float32)


@dataclass
class RefValues:
    """Reference sequence log-probs aligned with the data lists (all empty for SimPO)."""

    train_chosen: torch.Tensor
    train_rejected: torch.Tensor
    eval_chosen: torch.Tensor
    eval_rejected: torch.Tensor
    train_unpaired: torch.Tensor
    train_kl: torch.Tensor
    eval_unpaired: torch.Tensor


def compute_ref_values(
    cfg: RlbusConfig,
    data: PreferenceData,
    kl_seqs: list[Seq],
    device: torch.device,
    log: Callable[[str], None],
) -> RefValues:
    """One pass of the reference over every sequence the run scores, then reduced per use."""
    empty = torch.zeros(0)
    if cfg.preference.algorithm == "simpo":
        return RefValues(empty, empty, empty, empty, empty, empty, empty)
    parts: list[list[Seq]] = [
        [(p.prompt_ids, p.chosen_ids) for p in data.train_pairs],
        [(p.prompt_ids, p.rejected_ids) for p in data.train_pairs],
        [(p.prompt_ids, p.chosen_ids) for p in data.eval_pairs],
        [(p.prompt_ids, p.rejected_ids) for p in data.eval_pairs],
        [(e.prompt_ids, e.completion_ids) for e in data.train_unpaired],
        kl_seqs,
        [(e.prompt_ids, e.completion_ids) for e in data.eval_unpaired],
    ]
    if cfg.preference.algorithm == "kto":
        parts[0], parts[1] = [], []  # KTO trains on the unpaired examples (pairs unpaired already)
    else:
        parts[4], parts[5] = [], []  # DPO trains on pairs only
    t0 = time.perf_counter()
    flat = ref_logps(cfg, [s for part in parts for s in part], device, log)
    log(
        f"reference log-probs of {len(flat)} sequences ({cfg.preference.ref_source}) in "
        f"{time.perf_counter() - t0:.1f}s"
    )
    average, tensors, start = uses_average(cfg.preference), [], 0
    for part in parts:
        tensors.append(reduce_logps(flat[start : start + len(part)], average))
        start += len(part)
    return RefValues(*tensors)
