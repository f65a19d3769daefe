"""Critic loss for PPO with GAE: clipped value regression."""

from __future__ import annotations

import torch

from .policy_loss import aggregate_loss

__all__ = ["clipped_value_loss"]


def clipped_value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    clip_range: float | None = 0.5,
    loss_agg_mode: str = "token-mean",
    *,
    norm_length: int | float | None = None,
    global_tokens: int | float | torch.Tensor | None = None,
    global_seqs: int | float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``0.5 * max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2)``, aggregated over valid tokens.

    The pessimistic max keeps the critic from moving further than ``clip_range`` from the values the
    advantages were computed with, in the direction that would lower the loss (as PPO / verl).
    ``clip_range=None`` gives the plain squared error.

    Args:
        values: [B, T] current critic predictions (carries the gradient).
        old_values: [B, T] predictions at rollout time.
        returns: [B, T] regression targets (e.g. from ``gae_advantages``).
        response_mask: [B, T].

    Returns:
        (scalar loss, clipfrac): clipfrac is the detached fraction of valid tokens where the clipped
        error is the larger one.
    """
    mask = response_mask.to(values.dtype)
    returns = returns.detach()
    err_unclipped = (values - returns).square()
    if clip_range is None:
        loss_mat = err_unclipped
        clipped = torch.zeros_like(mask, dtype=torch.bool)
    else:
        old_values = old_values.detach()
        values_clipped = torch.clamp(values, old_values - clip_range, old_values + clip_range)
        err_clipped = (values_clipped - returns).square()
        loss_mat = torch.maximum(err_unclipped, err_clipped)
        clipped = err_clipped > err_unclipped
    loss = 0.5 * aggregate_loss(
        loss_mat,
        mask,
        loss_agg_mode,
        norm_length=norm_length,
        global_tokens=global_tokens,
        global_seqs=global_seqs,
    )
    with torch.no_grad():
        clipfrac = (clipped.to(mask.dtype) * mask).sum() / mask.sum().clamp(min=1.0)
    return loss, clipfrac
