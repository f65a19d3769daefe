"""Policy log-probs of pairs and examples, the per-algorithm losses, and the summed statistics of a batch."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch

from rlbus.config.schema import PreferenceConfig
from rlbus.learner.algorithms.preference import dpo_loss, sequence_logps, simpo_loss
from rlbus.learner.preference.dataset import (
    PreferencePair,
    pair_batch,
    sequence_batch,
)
from rlbus.modeling import token_logprobs


def resolve_beta(pcfg: PreferenceConfig) -> float:
    """The papers' defaults differ by an order of magnitude (DPO/KTO 0.1, SimPO 2.0), so None picks per algorithm."""
    if pcfg.beta is not None:
        return float(pcfg.beta)
    return 2.0 if pcfg.algorithm == "simpo" else 0.1


def uses_average(pcfg: PreferenceConfig) -> bool:
    """Length-averaged sequence log-probs for SimPO and IPO (as their papers and TRL do); sums otherwise."""
    return pcfg.algorithm == "simpo" or (pcfg.algorithm == "dpo" and pcfg.loss_type == "ipo")


# --------------------------------------------------------------------------------------------------
# forward passes and losses


def compute_precision(model: torch.nn.Module, device: torch.device) -> contextlib.AbstractContextManager:
    """bf16/fp16 autocast over fp32 master weights where the model builder asked for it (one GPU)."""
    amp = getattr(model, "_rlbus_autocast", None)
    return torch.autocast(device.type, dtype=amp) if amp is not None else contextlib.nullcontext()


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
    with compute_precision(model, device):
        lp = token_logprobs(
            model, b.input_ids, b.attention_mask, b.position_ids, positions=b.response_mask.bool()
        )
    return sequence_logps(lp, b.response_mask, average=average)


def pair_logps(
    model: torch.nn.Module, pairs: Sequence[PreferencePair], pad_id: int, device: torch.device, average: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen [B], rejected [B]) from one concatenated forward."""
    pb = pair_batch(pairs, pad_id)
    b = pb.sequences.to(device)
    with compute_precision(model, device):
        lp = token_logprobs(
            model, b.input_ids, b.attention_mask, b.position_ids, positions=b.response_mask.bool()
        )
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
