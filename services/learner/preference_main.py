"""Offline preference training: `rlbus train` with `preference.algorithm` set to dpo, kto or simpo.

The policy (`model.path`, or the bundled tiny model) is trained on fixed preference data against a frozen
reference (`ref.model_path`, or the policy's own initial weights). Reference log-probs are computed once,
up front, for every sequence the run will ever score (train, held-out, KTO's mismatched KL pairs): the
reference is frozen, so recomputing it per step would only cost time, and the reference model can be freed
before the policy trains. They come from the same `rlbus.modeling` path every other log-prob in the
project uses, either here (`ref_source=local`) or from the ref service over the bus (`ref_source=service`).
SimPO is reference-free and skips that entirely.

Per optimizer step: `batch_size` pairs (KTO: examples), in micro-batches of `micro_batch_size` with
gradient accumulation, AdamW, gradient clipping. Metrics (loss, chosen/rejected rewards, margin, accuracy)
go to the console and `<run.dir>/<run.id>/metrics.jsonl`; the held-out set is evaluated before and after
training (and every `trainer.test_freq` steps), and the final model is saved as a Hugging Face directory
in `<run.dir>/<run.id>/model`.
"""

from __future__ import annotations

import asyncio
import json
import math
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rlbus.config import RlbusConfig, save_config
from rlbus.config.schema import PreferenceConfig
from rlbus.learner.algorithms.preference import dpo_loss, kto_loss, sequence_logps, simpo_loss
from rlbus.learner.preference_data import (
    PreferencePair,
    UnpairedExample,
    iter_batches,
    kl_partners,
    make_synthetic_preferences,
    pair_batch,
    read_records,
    sequence_batch,
    split_holdout,
    tokenize_pairs,
    tokenize_unpaired,
    unpair,
)
from rlbus.modeling import load_causal_lm, load_tokenizer, pick_device, response_logprobs, token_logprobs

SUMMARY_FILE = "preference_summary.json"
MODEL_DIR = "model"
Seq = tuple[list[int], list[int]]  # (prompt ids, completion ids)


def is_preference_run(cfg: RlbusConfig) -> bool:
    """`rlbus train` dispatches here instead of starting the RL services when an algorithm is chosen."""
    return cfg.preference.algorithm != "none"


def resolve_beta(pcfg: PreferenceConfig) -> float:
    """The papers' defaults differ by an order of magnitude (DPO/KTO 0.1, SimPO 2.0), so None picks per algorithm."""
    if pcfg.beta is not None:
        return float(pcfg.beta)
    return 2.0 if pcfg.algorithm == "simpo" else 0.1


def uses_average(pcfg: PreferenceConfig) -> bool:
    """Length-averaged sequence log-probs for SimPO and IPO (as their papers and TRL do); sums otherwise."""
    return pcfg.algorithm == "simpo" or (pcfg.algorithm == "dpo" and pcfg.loss_type == "ipo")


# --------------------------------------------------------------------------------------------------
# data


@dataclass
class PreferenceData:
    """Tokenised train and held-out sets. Paired data trains DPO/SimPO (and KTO after unpairing) and is
    evaluated pairwise; unpaired rows (KTO only) are evaluated per example."""

    train_pairs: list[PreferencePair]
    eval_pairs: list[PreferencePair]
    train_unpaired: list[UnpairedExample]
    eval_unpaired: list[UnpairedExample]


def _rows(cfg: RlbusConfig, run_dir: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(train rows, val rows or None). Without files, a synthetic set from `data.task`, written to the run
    dir so the exact data a run trained on can be inspected and reused."""
    pcfg = cfg.preference
    if pcfg.train_files:
        return read_records(pcfg.train_files), (read_records(pcfg.val_files) if pcfg.val_files else None)
    from rlbus.tasks import get_task

    if cfg.data.task == "jsonl":
        raise ValueError(
            "preference.train_files is empty: list JSONL/parquet preference files there "
            "(data.task=jsonl names prompt files for RL, not preference pairs)"
        )
    task = get_task(cfg.data.task, digits=cfg.data.task_digits)
    train = make_synthetic_preferences(
        task, pcfg.synthetic_train_examples, pcfg.seed, "train", run_dir / "preferences_train.jsonl"
    )
    val = make_synthetic_preferences(
        task, pcfg.synthetic_val_examples, pcfg.seed, "val", run_dir / "preferences_val.jsonl"
    )
    return train, val


def _is_unpaired(rows: list[dict[str, Any]], pcfg: PreferenceConfig) -> bool:
    return bool(rows) and pcfg.chosen_key not in rows[0] and pcfg.completion_key in rows[0]


def build_data(cfg: RlbusConfig, tokenizer, run_dir: Path) -> PreferenceData:
    """Read, tokenise, truncate and split (held-out = val_files, else `eval_fraction` of train)."""
    pcfg = cfg.preference
    train_rows, val_rows = _rows(cfg, run_dir)
    trunc = dict(
        max_length=pcfg.max_length, max_prompt_length=pcfg.max_prompt_length, append_eos=pcfg.append_eos
    )
    pair_keys = (pcfg.prompt_key, pcfg.chosen_key, pcfg.rejected_key)
    kto_keys = (pcfg.prompt_key, pcfg.completion_key, pcfg.label_key)

    def tok(rows: list[dict[str, Any]]) -> tuple[list[PreferencePair], list[UnpairedExample]]:
        if _is_unpaired(rows, pcfg):
            if pcfg.algorithm != "kto":
                raise ValueError(
                    f"{pcfg.algorithm} needs paired rows ({', '.join(pair_keys)}); "
                    f"prompt/completion/label rows train KTO only"
                )
            return [], tokenize_unpaired(rows, tokenizer, keys=kto_keys, **trunc)
        return tokenize_pairs(rows, tokenizer, keys=pair_keys, **trunc), []

    train_pairs, train_unpaired = tok(train_rows)
    if val_rows is not None:
        eval_pairs, eval_unpaired = tok(val_rows)
    else:
        train_pairs, eval_pairs = split_holdout(train_pairs, pcfg.eval_fraction, pcfg.seed)
        train_unpaired, eval_unpaired = split_holdout(train_unpaired, pcfg.eval_fraction, pcfg.seed)
    if pcfg.algorithm == "kto" and train_pairs:
        train_unpaired = unpair(train_pairs)
    return PreferenceData(train_pairs, eval_pairs, train_unpaired, eval_unpaired)


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
                pid = d.message.scored.trajectories.work.prompt_id
                if pid not in pending:
                    await d.ack()  # an answer to an earlier attempt of this run: nobody else wants it
                    continue
                for i, lp in zip(pending.pop(pid), d.message.ref_logprobs or [], strict=True):
                    out[i] = np.asarray(lp, dtype=np.float32)
                await d.ack()
        await consumer.close()
    finally:
        await bus.close()
    return out  # type: ignore[return-value]


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


# --------------------------------------------------------------------------------------------------
# forward passes and losses


def policy_logps(
    model: torch.nn.Module,
    prompts: Sequence[list[int]],
    completions: Sequence[list[int]],
    pad_id: int,
    device: torch.device,
    average: bool,
) -> torch.Tensor:
    """Differentiable sequence log-probs [B] through `rlbus.modeling.token_logprobs`, the path the
    reference took, so that policy and reference agree exactly at step 0."""
    b = sequence_batch(prompts, completions, pad_id).to(device)
    lp = token_logprobs(model, b.input_ids, b.attention_mask, b.position_ids)
    return sequence_logps(lp, b.response_mask, average=average)


def pair_logps(
    model: torch.nn.Module, pairs: Sequence[PreferencePair], pad_id: int, device: torch.device, average: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen [B], rejected [B]) from one concatenated forward."""
    pb = pair_batch(pairs, pad_id)
    b = pb.sequences.to(device)
    lp = token_logprobs(model, b.input_ids, b.attention_mask, b.position_ids)
    seq = sequence_logps(lp, b.response_mask, average=average)
    return seq[: pb.size], seq[pb.size :]


def pairwise_losses(
    pcfg: PreferenceConfig,
    beta: float,
    pc: torch.Tensor,
    pr: torch.Tensor,
    rc: torch.Tensor,
    rr: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(losses, chosen rewards, rejected rewards) of DPO (any loss_type) or SimPO (which ignores rc, rr)."""
    if pcfg.algorithm == "simpo":
        return simpo_loss(pc, pr, beta, pcfg.simpo_gamma, pcfg.label_smoothing)
    return dpo_loss(pc, pr, rc, rr, beta, pcfg.loss_type, pcfg.label_smoothing)


def _pair_stats(
    losses: torch.Tensor | None, cr: torch.Tensor, rr: torch.Tensor, pc: torch.Tensor, pr: torch.Tensor
) -> dict[str, float]:
    """Summed statistics of a (micro-)batch of pairs; `_finish` divides by the count."""
    stats = {
        "rewards_chosen": float(cr.sum()),
        "rewards_rejected": float(rr.sum()),
        "margin": float((cr - rr).sum()),
        "accuracy": float((cr > rr).float().sum()),
        "logps_chosen": float(pc.detach().sum()),
        "logps_rejected": float(pr.detach().sum()),
    }
    if losses is not None:
        stats["loss"] = float(losses.detach().sum())
    return stats


def _unpaired_stats(
    losses: torch.Tensor | None, rewards: torch.Tensor, desirable: torch.Tensor, logps: torch.Tensor
) -> dict[str, float]:
    """KTO sums: rewards split by label (rejected = undesirable); accuracy = the reward's sign matches the label."""
    d = desirable.float()
    stats = {
        "rewards_chosen_sum": float((rewards * d).sum()),
        "n_chosen": float(d.sum()),
        "rewards_rejected_sum": float((rewards * (1 - d)).sum()),
        "n_rejected": float((1 - d).sum()),
        "accuracy": float(((rewards > 0) == desirable).float().sum()),
        "logps": float(logps.detach().sum()),
    }
    if losses is not None:
        stats["loss"] = float(losses.detach().sum())
    return stats


def _add(acc: dict[str, float], stats: dict[str, float]) -> None:
    for k, v in stats.items():
        acc[k] = acc.get(k, 0.0) + v


def _finish(acc: dict[str, float], n: int) -> dict[str, float]:
    """Sums -> means; KTO's per-label sums -> per-label means and their margin."""
    out: dict[str, float] = {}
    if "n_chosen" in acc:
        c = acc.pop("rewards_chosen_sum") / max(acc["n_chosen"], 1.0)
        r = acc.pop("rewards_rejected_sum") / max(acc["n_rejected"], 1.0)
        out.update(rewards_chosen=c, rewards_rejected=r, margin=c - r)
        acc.pop("n_chosen"), acc.pop("n_rejected")
    out.update({k: v / max(n, 1) for k, v in acc.items()})
    return out


def chunks(items: Sequence[int], size: int) -> list[list[int]]:
    return [list(items[i : i + size]) for i in range(0, len(items), size)]


# --------------------------------------------------------------------------------------------------
# training


@dataclass
class Trainer:
    """The pieces one step needs; methods are the per-algorithm forward/backward of one batch."""

    cfg: RlbusConfig
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    data: PreferenceData
    ref: RefValues
    kl_seqs: list[Seq]
    pad_id: int
    device: torch.device
    beta: float

    @property
    def pcfg(self) -> PreferenceConfig:
        return self.cfg.preference

    def train_size(self) -> int:
        return len(self.data.train_unpaired) if self.pcfg.algorithm == "kto" else len(self.data.train_pairs)

    def _pair_micro(self, idx: list[int], scale: float) -> dict[str, float]:
        """Forward + backward of DPO/SimPO on some pairs; the loss is scaled by 1/batch so the accumulated
        gradient equals the gradient of the batch mean, whatever the micro-batch split."""
        pairs = [self.data.train_pairs[i] for i in idx]
        pc, pr = pair_logps(self.model, pairs, self.pad_id, self.device, uses_average(self.pcfg))
        rc = self.ref.train_chosen[idx].to(self.device) if len(self.ref.train_chosen) else pc.detach()
        rr = self.ref.train_rejected[idx].to(self.device) if len(self.ref.train_rejected) else pr.detach()
        losses, cr, rw = pairwise_losses(self.pcfg, self.beta, pc, pr, rc, rr)
        (losses.sum() * scale).backward()
        return _pair_stats(losses, cr, rw, pc, pr)

    @torch.no_grad()
    def kto_kl(self, idx: list[int]) -> torch.Tensor:
        """KTO's reference point: the batch mean of log pi - log ref on mismatched prompt/completion pairs
        (no gradient; `kto_loss` clamps it at 0)."""
        prompts = [self.kl_seqs[i][0] for i in idx]
        comps = [self.kl_seqs[i][1] for i in idx]
        logps = policy_logps(self.model, prompts, comps, self.pad_id, self.device, average=False)
        return (logps - self.ref.train_kl[idx].to(self.device)).mean()

    def _kto_micro(self, idx: list[int], scale: float, kl: torch.Tensor) -> dict[str, float]:
        examples = [self.data.train_unpaired[i] for i in idx]
        logps = policy_logps(
            self.model,
            [e.prompt_ids for e in examples],
            [e.completion_ids for e in examples],
            self.pad_id,
            self.device,
            average=False,
        )
        desirable = torch.tensor([e.desirable for e in examples], device=self.device)
        losses, rewards = kto_loss(
            logps,
            self.ref.train_unpaired[idx].to(self.device),
            desirable,
            kl,
            self.beta,
            self.pcfg.kto_desirable_weight,
            self.pcfg.kto_undesirable_weight,
        )
        (losses.sum() * scale).backward()
        return _unpaired_stats(losses, rewards, desirable, logps)

    def step(self, batch: list[int]) -> dict[str, float]:
        """One optimizer step over `batch` (indices), accumulated over micro-batches."""
        self.model.train()
        acc: dict[str, float] = {}
        scale = 1.0 / len(batch)
        kl = self.kto_kl(batch) if self.pcfg.algorithm == "kto" else None
        for micro in chunks(batch, self.pcfg.micro_batch_size):
            _add(acc, self._kto_micro(micro, scale, kl) if kl is not None else self._pair_micro(micro, scale))
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.pcfg.grad_clip)
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        out = _finish(acc, len(batch))
        out.update(grad_norm=float(grad_norm), lr=float(lr))
        if kl is not None:
            out["kl"] = float(kl)
        return out

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Held-out margin and accuracy with the rewards the algorithm trains (DPO/KTO: beta * (pi - ref),
        SimPO: beta * avg log pi), plus `policy_accuracy`: how often the policy itself gives the chosen
        completion the higher log-likelihood, comparable across algorithms."""
        self.model.eval()
        avg = uses_average(self.pcfg)
        acc: dict[str, float] = {}
        if self.data.eval_pairs:
            n = len(self.data.eval_pairs)
            for idx in chunks(range(n), self.pcfg.eval_batch_size):
                pairs = [self.data.eval_pairs[i] for i in idx]
                pc, pr = pair_logps(self.model, pairs, self.pad_id, self.device, avg)
                if self.pcfg.algorithm == "simpo":
                    rc = rr = torch.zeros_like(pc)
                else:
                    rc, rr = (
                        self.ref.eval_chosen[idx].to(self.device),
                        self.ref.eval_rejected[idx].to(self.device),
                    )
                if self.pcfg.algorithm == "kto":
                    losses, cr, rw = None, self.beta * (pc - rc), self.beta * (pr - rr)
                else:
                    losses, cr, rw = pairwise_losses(self.pcfg, self.beta, pc, pr, rc, rr)
                _add(acc, _pair_stats(losses, cr, rw, pc, pr))
                _add(acc, {"policy_accuracy": float((pc > pr).float().sum())})
            return _finish(acc, n)
        n = len(self.data.eval_unpaired)
        for idx in chunks(range(n), self.pcfg.eval_batch_size):
            ex = [self.data.eval_unpaired[i] for i in idx]
            logps = policy_logps(
                self.model,
                [e.prompt_ids for e in ex],
                [e.completion_ids for e in ex],
                self.pad_id,
                self.device,
                average=False,
            )
            rewards = self.beta * (logps - self.ref.eval_unpaired[idx].to(self.device))
            desirable = torch.tensor([e.desirable for e in ex], device=self.device)
            _add(acc, _unpaired_stats(None, rewards, desirable, logps))
        return _finish(acc, n) if n else {}


def disable_dropout(model: torch.nn.Module) -> None:
    """Dropout off (TRL's default for DPO): with it, the policy's log-probs at step 0 would differ from
    the reference's by noise alone, and every reward would start off zero."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):
            module.attention_dropout = 0.0


def build_optimizer(model: torch.nn.Module, pcfg: PreferenceConfig):
    """AdamW with linear warmup over `lr_warmup_steps`, then a constant rate."""
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=pcfg.lr, weight_decay=pcfg.weight_decay)
    warmup = pcfg.lr_warmup_steps
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup) if warmup > 0 else 1.0
    )
    return optimizer, scheduler


def total_steps(pcfg: PreferenceConfig, n_train: int) -> int:
    per_epoch = math.ceil(n_train / pcfg.batch_size)
    steps = pcfg.epochs * per_epoch
    return min(steps, pcfg.max_steps) if pcfg.max_steps else steps


def progress_line(step: int, total: int, m: dict[str, Any], prefix: str = "train") -> str:
    """What a person watches: loss, the two rewards, their margin and the pairwise accuracy."""

    def f(key: str, fmt: str = "{:.4f}") -> str:
        v = m.get(f"{prefix}/{key}")
        return "-" if v is None else fmt.format(v)

    return (
        f"[{prefix}] step {step}/{total} | loss {f('loss')} | chosen {f('rewards_chosen')} | "
        f"rejected {f('rewards_rejected')} | margin {f('margin')} | acc {f('accuracy', '{:.3f}')}"
    )


def _prefixed(prefix: str, metrics: dict[str, float]) -> dict[str, float]:
    return {f"{prefix}/{k}": v for k, v in metrics.items()}


def fresh_metrics_file(run_dir: Path) -> None:
    """A preference run never resumes, so an earlier run's metrics under the same run id are moved aside
    (not appended to: two step-0 evals in one file would make every curve wrong)."""
    from rlbus.metrics_log import METRICS_FILE

    path = run_dir / METRICS_FILE
    if path.exists():
        n = 1
        while (run_dir / f"{METRICS_FILE}.{n}").exists():
            n += 1
        path.rename(run_dir / f"{METRICS_FILE}.{n}")
        _log(f"moved the previous {METRICS_FILE} of run {run_dir.name} to {METRICS_FILE}.{n}")


def _log(msg: str) -> None:
    print(f"[preference] {msg}", file=sys.stderr, flush=True)


def build_trainer(cfg: RlbusConfig, run_dir: Path) -> tuple[Trainer, Any]:
    """Data, reference log-probs (before the policy is loaded, so the two models never share memory),
    then the trainable policy and its optimizer. Returns (trainer, tokenizer)."""
    from rlbus.model_source import resolve_model_path

    pcfg = cfg.preference
    torch.manual_seed(pcfg.seed)
    device = pick_device(cfg.trainer.device)
    policy_path = resolve_model_path(cfg.model.path, cfg.model.use_shm)
    tokenizer = load_tokenizer(policy_path, cfg.model.trust_remote_code)
    data = build_data(cfg, tokenizer, run_dir)
    kl_seqs = kl_partners(data.train_unpaired, pcfg.seed) if pcfg.algorithm == "kto" else []
    n_train = len(data.train_unpaired) if pcfg.algorithm == "kto" else len(data.train_pairs)
    if n_train == 0:
        raise ValueError("no training examples left after holding out the eval split")
    _log(
        f"{pcfg.algorithm}: {n_train} train, {len(data.eval_pairs) or len(data.eval_unpaired)} held-out; "
        f"policy {policy_path}; device {device}"
    )
    ref = compute_ref_values(cfg, data, kl_seqs, device, _log)
    model = load_causal_lm(
        policy_path, cfg.model.dtype, device, trainable=True, trust_remote_code=cfg.model.trust_remote_code
    )
    if cfg.model.enable_gradient_checkpointing:
        model.gradient_checkpointing_enable()
    if cfg.model.lora_rank:
        _log("model.lora_rank is ignored here: preference training fine-tunes every weight")
    disable_dropout(model)
    optimizer, scheduler = build_optimizer(model, pcfg)
    trainer = Trainer(
        cfg,
        model,
        optimizer,
        scheduler,
        data,
        ref,
        kl_seqs,
        int(tokenizer.pad_token_id),
        device,
        resolve_beta(pcfg),
    )
    return trainer, tokenizer


def check_finite(metrics: dict[str, float], step: int) -> None:
    """Stop at the first NaN/inf: a diverged run must not be saved as if it had trained."""
    for key, value in metrics.items():
        if not math.isfinite(value):
            raise FloatingPointError(f"{key} = {value} at step {step}")


def train_loop(trainer: Trainer, writer: Any, steps: int, console: bool) -> tuple[dict, dict, int]:
    """Eval, `steps` optimizer steps (epochs reshuffled), eval; returns (eval before, eval after, steps done)."""
    cfg, pcfg = trainer.cfg, trainer.pcfg

    def evaluate(step: int) -> dict[str, float]:
        m = _prefixed("eval", trainer.evaluate())
        writer.log(step, m)
        if console:
            print(progress_line(step, steps, m, "eval"), flush=True)
        return m

    before = evaluate(0)
    step, t0 = 0, time.perf_counter()
    for epoch in range(pcfg.epochs):
        for batch in iter_batches(
            trainer.train_size(), pcfg.batch_size, shuffle=True, seed=pcfg.seed, epoch=epoch
        ):
            if step >= steps:
                break
            step += 1
            m = _prefixed("train", trainer.step(batch))
            m.update({"train/epoch": float(epoch), "perf/step_s": (time.perf_counter() - t0) / step})
            check_finite(m, step)
            writer.log(step, m)
            if console and (step % pcfg.log_every == 0 or step == steps):
                print(progress_line(step, steps, m), flush=True)
            if cfg.trainer.test_freq > 0 and step % cfg.trainer.test_freq == 0 and step < steps:
                evaluate(step)
    return before, evaluate(step), step


def train_preference(cfg: RlbusConfig) -> dict[str, Any]:
    """The whole offline run; returns the summary also written to `<run dir>/preference_summary.json`."""
    from rlbus.metrics_log import MetricsWriter

    pcfg = cfg.preference
    run_dir = Path(cfg.run.dir) / cfg.run.id
    run_dir.mkdir(parents=True, exist_ok=True)
    save_config(cfg, run_dir / "config.yaml")
    trainer, tokenizer = build_trainer(cfg, run_dir)
    steps = total_steps(pcfg, trainer.train_size())
    fresh_metrics_file(run_dir)
    loggers = [x for x in cfg.trainer.logger if x != "console"]  # its RL progress line does not fit here
    writer = MetricsWriter(run_dir, loggers, steps, cfg.trainer.project_name, cfg.trainer.experiment_name)
    try:
        before, after, done = train_loop(trainer, writer, steps, "console" in cfg.trainer.logger)
    finally:
        writer.close()
    summary: dict[str, Any] = {"algorithm": pcfg.algorithm, "steps": done, "before": before, "after": after}
    if pcfg.save_model:
        out = run_dir / MODEL_DIR
        trainer.model.save_pretrained(str(out))
        tokenizer.save_pretrained(str(out))
        summary["model_dir"] = str(out)
        _log(f"saved the trained model to {out}")
    (run_dir / SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n")
    nan = float("nan")
    _log(
        f"held-out margin {before.get('eval/margin', nan):.4f} -> {after.get('eval/margin', nan):.4f}, "
        f"accuracy {before.get('eval/accuracy', nan):.3f} -> {after.get('eval/accuracy', nan):.3f}"
    )
    return summary


def run_preference(cfg: RlbusConfig) -> int:
    """`rlbus train` entry: 0 when trained (and saved); data and config problems print one line and give 2,
    a diverged run (NaN/inf) gives 1, without a traceback a user has to read through."""
    try:
        train_preference(cfg)
    except (ValueError, FileNotFoundError, TimeoutError) as exc:
        _log(f"error: {exc}")
        return 2
    except FloatingPointError as exc:
        _log(f"diverged: {exc}")
        return 1
    return 0
