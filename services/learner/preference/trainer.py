"""The preference trainer: one optimizer step of DPO, KTO or SimPO over a batch, and held-out evaluation."""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from rlbus.config import RlbusConfig
from rlbus.config.schema import PreferenceConfig
from rlbus.config.training import OptimConfig
from rlbus.learner.algorithms.preference import kto_loss
from rlbus.learner.dist.context import DistContext, init_distributed
from rlbus.learner.model import build_policy_model, clip_grad_norm
from rlbus.learner.optim import build_optimizer, build_scheduler
from rlbus.learner.preference.data import PreferenceData, Seq, build_data
from rlbus.learner.preference.dataset import (
    kl_partners,
)
from rlbus.learner.preference.losses import (
    _add,
    _finish,
    _pair_stats,
    _unpaired_stats,
    chunks,
    pair_logps,
    pairwise_losses,
    policy_logps,
    resolve_beta,
    uses_average,
)
from rlbus.learner.preference.reference import RefValues, compute_ref_values
from rlbus.modeling import load_tokenizer, pick_device

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
    ctx: DistContext = field(default_factory=DistContext)

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
        """One optimizer step over `batch` (indices), accumulated over micro-batches.

        Under torchrun each rank trains on its share of the batch (`rank_shares`) and every rank runs the
        same number of forward/backward passes (each is a collective under FSDP2): a rank with fewer
        micro-batches runs zero-weighted ones. The loss is scaled by world / batch so that FSDP's mean over
        ranks gives exactly the gradient of the batch mean one process computes."""
        self.model.train()
        acc: dict[str, float] = {}
        world = self.ctx.world_size if self.ctx.distributed else 1
        scale = world / len(batch)
        kl = self.kto_kl(batch) if self.pcfg.algorithm == "kto" else None
        shares = rank_shares(batch, world)
        passes = max(len(chunks(share, self.pcfg.micro_batch_size)) for share in shares)
        mine = chunks(shares[self.ctx.rank if world > 1 else 0], self.pcfg.micro_batch_size)
        for i in range(passes):
            micro, weight = (mine[i], scale) if i < len(mine) else ([batch[0]], 0.0)
            stats = self._kto_micro(micro, weight, kl) if kl is not None else self._pair_micro(micro, weight)
            if weight:
                _add(acc, stats)
        grad_norm = clip_grad_norm(self.model.parameters(), self.pcfg.grad_clip)
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        out = _finish(sum_over_ranks(self.ctx, acc), len(batch))
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
            module.attention_dropout = 0.0  # type: ignore[assignment]  # a float attribute, not a submodule


def _log(msg: str) -> None:
    print(f"[preference] {msg}", file=sys.stderr, flush=True)


def rank_shares(batch: list[int], world: int) -> list[list[int]]:
    """The batch dealt into `world` contiguous shares, as even as possible (sizes differ by at most one)."""
    base, extra = divmod(len(batch), world)
    out, start = [], 0
    for r in range(world):
        size = base + (1 if r < extra else 0)
        out.append(batch[start : start + size])
        start += size
    return out


def sum_over_ranks(ctx: DistContext, acc: dict[str, float]) -> dict[str, float]:
    """Each statistic summed over the ranks (keys a rank lacks count as 0); unchanged on one process."""
    if not ctx.distributed:
        return acc
    gathered: list[dict[str, float] | None] = [None] * ctx.world_size
    torch.distributed.all_gather_object(gathered, acc)
    total: dict[str, float] = {}
    for part in gathered:
        _add(total, part or {})
    return total


def shared_ref_values(ctx: DistContext, compute: Callable[[], RefValues]) -> RefValues:
    """Reference values computed once, on rank 0 (the only rank that may talk to the ref service), and
    handed to the other ranks."""
    if not ctx.distributed:
        return compute()
    box: list[RefValues | None] = [compute() if ctx.rank == 0 else None]
    torch.distributed.broadcast_object_list(box, src=0)
    assert box[0] is not None
    return box[0]


def preference_optim(pcfg: PreferenceConfig) -> OptimConfig:
    """The preference keys as the RL learner's optimiser section: AdamW, linear warmup, then constant."""
    return OptimConfig(
        lr=pcfg.lr,
        weight_decay=pcfg.weight_decay,
        lr_warmup_steps=pcfg.lr_warmup_steps,
        lr_scheduler="constant",
    )


def build_trainer(cfg: RlbusConfig, run_dir: Path, total: Callable[[int], int]) -> tuple[Trainer, Any]:
    """Data, reference log-probs (before the policy is loaded, so the two models never share memory),
    then the trainable policy (the RL learner's model path: FSDP2 under torchrun, LoRA, Liger, gradient
    checkpointing) and its optimizer over `total(n_train)` steps. Returns (trainer, tokenizer)."""
    from rlbus.model_source import resolve_model_path

    pcfg = cfg.preference
    torch.manual_seed(pcfg.seed)
    ctx = init_distributed(cfg.trainer.device)
    device = ctx.device if ctx.initialized else pick_device(cfg.trainer.device)
    policy_path = resolve_model_path(cfg.model.path, cfg.model.use_shm)
    tokenizer = load_tokenizer(policy_path, cfg.model.trust_remote_code)
    data = build_data(cfg, tokenizer, run_dir if ctx.is_leader else None)
    kl_seqs = kl_partners(data.train_unpaired, pcfg.seed) if pcfg.algorithm == "kto" else []
    n_train = len(data.train_unpaired) if pcfg.algorithm == "kto" else len(data.train_pairs)
    if n_train == 0:
        raise ValueError("no training examples left after holding out the eval split")
    _log(
        f"{pcfg.algorithm}: {n_train} train, {len(data.eval_pairs) or len(data.eval_unpaired)} held-out; "
        f"policy {policy_path}; device {device}; ranks {ctx.world_size}"
    )
    ref = shared_ref_values(ctx, lambda: compute_ref_values(cfg, data, kl_seqs, device, _log))
    if not ctx.initialized:
        ctx = DistContext(device=device)
    model = build_policy_model(cfg, policy_path, ctx)
    disable_dropout(model)
    optimizer = build_optimizer(model, preference_optim(pcfg))
    scheduler = build_scheduler(optimizer, preference_optim(pcfg), total(n_train))
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
        ctx,
    )
    return trainer, tokenizer
