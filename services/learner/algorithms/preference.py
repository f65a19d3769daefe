"""Offline preference losses: DPO (sigmoid / IPO / hinge), KTO and SimPO, following TRL's definitions.

Inputs are per-sequence log-probs ``[B]`` (sum or mean over response tokens, see ``sequence_logps``).
Losses are returned per sample so the caller chooses the reduction; rewards are detached, for logging.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["DPO_LOSS_TYPES", "dpo_loss", "kto_loss", "sequence_logps", "simpo_loss"]

DPO_LOSS_TYPES = ("sigmoid", "ipo", "hinge")


def sequence_logps(token_logps: torch.Tensor, mask: torch.Tensor, average: bool = False) -> torch.Tensor:
    """Sum (DPO, KTO) or length-average (IPO, SimPO) of token log-probs over valid tokens.

    Args:
        token_logps: [B, T] log-probs of the response tokens.
        mask: [B, T] response mask.

    Returns:
        [B]; an empty row gives 0.
    """
    mask = mask.to(token_logps.dtype)
    total = (token_logps * mask).sum(-1)
    if average:
        return total / mask.sum(-1).clamp(min=1.0)
    return total


def dpo_loss(
    policy_chosen_logps: torch.Tensor,
    policy_rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    beta: float = 0.1,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """DPO family on ``logits = (pi_c - pi_r) - (ref_c - ref_r)``.

    ``sigmoid``: ``-(1 - ls) * logsigmoid(beta * logits) - ls * logsigmoid(-beta * logits)`` (conservative
    DPO when ``label_smoothing`` > 0, i.e. labels flipped with that probability). ``ipo``:
    ``(logits - 1 / (2 * beta))^2`` (regresses the margin instead of saturating; the paper uses
    length-averaged log-probs). ``hinge``: ``relu(1 - beta * logits)`` (SLiC).

    Args:
        All log-prob inputs: [B].

    Returns:
        (losses [B], chosen_rewards [B], rejected_rewards [B]) with rewards ``beta * (pi - ref)``, detached.
    """
    logits = (policy_chosen_logps - policy_rejected_logps) - (ref_chosen_logps - ref_rejected_logps)
    if loss_type == "sigmoid":
        losses = (
            -F.logsigmoid(beta * logits) * (1.0 - label_smoothing)
            - F.logsigmoid(-beta * logits) * label_smoothing
        )
    elif loss_type == "ipo":
        losses = (logits - 1.0 / (2.0 * beta)).square()
    elif loss_type == "hinge":
        losses = torch.relu(1.0 - beta * logits)
    else:
        raise ValueError(f"unknown DPO loss_type {loss_type!r}; expected one of {DPO_LOSS_TYPES}")
    chosen_rewards = beta * (policy_chosen_logps - ref_chosen_logps).detach()
    rejected_rewards = beta * (policy_rejected_logps - ref_rejected_logps).detach()
    return losses, chosen_rewards, rejected_rewards


def kto_loss(
    policy_logps: torch.Tensor,
    ref_logps: torch.Tensor,
    is_desirable: torch.Tensor,
    kl_reference: torch.Tensor,
    beta: float = 0.1,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """KTO on unpaired samples: desirable ``1 - sigmoid(beta * (logratio - KL))``, undesirable
    ``1 - sigmoid(beta * (KL - logratio))``, with ``logratio = pi - ref``.

    ``kl_reference`` is the batch estimate of KL(pi || ref) on mismatched pairs; as in TRL it is detached
    and clamped at 0, acting as the reference point of the value function.

    Args:
        policy_logps, ref_logps: [B] sequence log-probs.
        is_desirable: [B] bool.
        kl_reference: scalar tensor.

    Returns:
        (losses [B] weighted by desirable/undesirable weight, rewards [B] = ``beta * logratio`` detached),
        both in input order.
    """
    kl = kl_reference.detach().clamp(min=0.0)
    logratio = policy_logps - ref_logps
    desirable = is_desirable.to(torch.bool)
    desirable_losses = desirable_weight * (1.0 - torch.sigmoid(beta * (logratio - kl)))
    undesirable_losses = undesirable_weight * (1.0 - torch.sigmoid(beta * (kl - logratio)))
    losses = torch.where(desirable, desirable_losses, undesirable_losses)
    return losses, beta * logratio.detach()


def simpo_loss(
    chosen_avg_logps: torch.Tensor,
    rejected_avg_logps: torch.Tensor,
    beta: float = 2.0,
    gamma: float = 0.5,
    label_smoothing: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """SimPO: reference-free, ``-logsigmoid(beta * (avg_c - avg_r) - gamma)`` with a target margin ``gamma``.

    Length-averaged log-probs (``sequence_logps(..., average=True)``) remove the length bias;
    ``label_smoothing`` as in conservative DPO (TRL's CPO trainer with ``loss_type="simpo"``).

    Returns:
        (losses [B], chosen_rewards [B], rejected_rewards [B]) with rewards ``beta * avg_logps``, detached.
    """
    logits = beta * (chosen_avg_logps - rejected_avg_logps) - gamma
    losses = -F.logsigmoid(logits) * (1.0 - label_smoothing) - F.logsigmoid(-logits) * label_smoothing
    return losses, beta * chosen_avg_logps.detach(), beta * rejected_avg_logps.detach()
