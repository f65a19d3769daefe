"""Policy-gradient losses: PPO clip (with clip-higher and dual-clip), GSPO, truncated IS, entropy.

Pure functions of tensors. Token tensors are ``[B, T]``; ``response_mask`` is 1 on response tokens and 0 on
padding. Losses are to be minimised. ``stats`` values are detached 0-dim tensors (no device sync here; call
``float()`` when logging).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

__all__ = [
    "LOSS_AGG_MODES",
    "aggregate_loss",
    "gspo_loss",
    "ppo_clip_loss",
    "truncated_is_weights",
    "user_policy_loss",
]

GSPO_LOSS_AGG_MODE = "seq-mean-token-mean"
"""verl's GSPO aggregates this way whatever `loss_agg_mode` says (the paper's sequence-level objective)."""

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")

# Bound on |log ratio| before exp: a wildly stale token must not overflow to inf (verl uses the same bounds).
_MAX_LOG_RATIO = 20.0
_MAX_SEQ_LOG_RATIO = 10.0


def _masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (values * mask).sum() / mask.sum().clamp(min=1.0)


def aggregate_loss(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    mode: str = "token-mean",
    *,
    norm_length: int | float | None = None,
    global_tokens: int | float | torch.Tensor | None = None,
    global_seqs: int | float | torch.Tensor | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss ``[B, T]`` to a scalar; the mode decides how long and short answers weigh.

    Modes:
        ``token-mean``: sum over valid tokens / number of valid tokens (DAPO; every token weighs the same).
        ``seq-mean-token-sum``: per-sequence token sum, mean over sequences.
        ``seq-mean-token-mean``: per-sequence token mean, mean over sequences (original GRPO).
        ``seq-mean-token-sum-norm``: per-sequence token sum / ``norm_length``, mean over sequences
            (Dr.GRPO). ``norm_length`` should be a constant such as the configured max response length, so
            no sequence's length changes its weight; it defaults to ``T``, which is only constant when the
            batch is padded to the max length.

    Sequences with no valid token are not counted in "mean over sequences".

    Gradient accumulation: a mean over each micro-batch weighs micro-batches equally, not tokens. To get
    the full-batch loss as a *sum* of micro-batch losses, pass the whole batch's count: ``global_tokens``
    (valid tokens, for ``token-mean``) or ``global_seqs`` (sequences, for the ``seq-mean-*`` modes); the
    function then divides by that count instead of the local one. Under data parallelism with averaged
    gradients, pass the global count divided by the world size.

    Args:
        loss_mat: [B, T] per-token loss.
        mask: [B, T] response mask.
    """
    mask = mask.to(loss_mat.dtype)
    if mode == "token-mean":
        denom = mask.sum().clamp(min=1.0) if global_tokens is None else global_tokens
        return (loss_mat * mask).sum() / denom
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode {mode!r}; expected one of {LOSS_AGG_MODES}")
    tokens_per_seq = mask.sum(-1)
    seq_sums = (loss_mat * mask).sum(-1)
    if mode == "seq-mean-token-sum":
        seq_losses = seq_sums
    elif mode == "seq-mean-token-mean":
        seq_losses = seq_sums / tokens_per_seq.clamp(min=1.0)
    else:
        length = loss_mat.shape[-1] if norm_length is None else norm_length
        if length <= 0:
            raise ValueError(f"norm_length must be positive, got {length}")
        seq_losses = seq_sums / length
    if global_seqs is None:
        global_seqs = (tokens_per_seq > 0).to(loss_mat.dtype).sum().clamp(min=1.0)
    return seq_losses.sum() / global_seqs


def _clipped_surrogate(
    ratio: torch.Tensor, advantages: torch.Tensor, clip_low: float, clip_high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's pessimistic per-token loss ``max(-A*r, -A*clip(r, 1-low, 1+high))`` and where the clip won."""
    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    return torch.maximum(loss_unclipped, loss_clipped), loss_clipped > loss_unclipped


def ppo_clip_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip_c: float | None = None,
    loss_agg_mode: str = "token-mean",
    is_weights: torch.Tensor | None = None,
    *,
    norm_length: int | float | None = None,
    global_tokens: int | float | torch.Tensor | None = None,
    global_seqs: int | float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate ``max(-A * r, -A * clip(r, 1 - clip_low, 1 + clip_high))`` per token.

    ``clip_high > clip_low`` is DAPO's clip-higher (more room for raising unlikely tokens). With
    ``dual_clip_c`` (> 1), tokens with negative advantage are additionally bounded by ``-A * c`` so a huge
    ratio on a bad token cannot blow up the loss (Ye et al., dual-clip PPO). ``is_weights`` (detached,
    e.g. from ``truncated_is_weights``) multiply the per-token loss to correct for a stale behaviour policy.

    Args:
        logprobs: [B, T] current policy log-probs (carries the gradient).
        old_logprobs: [B, T] log-probs of the policy the advantages belong to (no gradient).
        advantages: [B, T].
        response_mask: [B, T].
        is_weights: optional [B, T].

    Returns:
        (scalar loss, stats) with stats ``clipfrac`` (tokens where the clip is active), ``approx_kl`` (mean of
        old - new log-prob), ``ratio_mean``, ``dual_clip_frac`` (tokens bounded by the dual clip).
    """
    if dual_clip_c is not None and dual_clip_c <= 1.0:
        raise ValueError(f"dual_clip_c must be > 1, got {dual_clip_c}")
    mask = response_mask.to(logprobs.dtype)
    old_logprobs = old_logprobs.detach()
    advantages = advantages.detach()
    log_ratio = (logprobs - old_logprobs).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio)
    loss_mat, clipped = _clipped_surrogate(ratio, advantages, clip_low, clip_high)
    dual_clipped = torch.zeros_like(clipped)
    if dual_clip_c is not None:
        bound = -advantages * dual_clip_c
        negative = advantages < 0
        dual_clipped = negative & (loss_mat > bound)
        loss_mat = torch.where(negative, torch.minimum(loss_mat, bound), loss_mat)
    if is_weights is not None:
        loss_mat = loss_mat * is_weights.detach()
    loss = aggregate_loss(
        loss_mat,
        mask,
        loss_agg_mode,
        norm_length=norm_length,
        global_tokens=global_tokens,
        global_seqs=global_seqs,
    )
    with torch.no_grad():
        stats = {
            "clipfrac": _masked_mean(clipped.to(mask.dtype), mask),
            "approx_kl": _masked_mean(-(logprobs.detach() - old_logprobs), mask),
            "ratio_mean": _masked_mean(ratio.detach(), mask),
            "dual_clip_frac": _masked_mean(dual_clipped.to(mask.dtype), mask),
        }
    return loss, stats


def gspo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
    loss_agg_mode: str = "seq-mean-token-mean",
    is_weights: torch.Tensor | None = None,
    *,
    norm_length: int | float | None = None,
    global_tokens: int | float | torch.Tensor | None = None,
    global_seqs: int | float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO: clip a *sequence-level* ratio ``s_i = exp(mean_t log(pi / pi_old))`` instead of token ratios.

    Uses the GSPO-token form ``s_it = sg[s_i] * pi(y_t) / sg[pi(y_t)]``: its value is ``s_i`` on every token
    and with sequence advantages and ``seq-mean-token-mean`` its gradient equals sequence-level GSPO, so the
    gradient reaches every token of a sequence and a clipped sequence contributes none at all. Clip ranges
    are tiny (the ratio is a geometric mean), e.g. 3e-4 / 4e-4.

    Args:
        logprobs, old_logprobs, advantages, response_mask: [B, T].
        is_weights: optional detached [B, T] weights multiplied into the per-token loss.

    Returns:
        (scalar loss, stats) with ``clipfrac`` (fraction of valid tokens in clipped sequences),
        ``approx_kl`` (token mean of old - new), ``ratio_mean`` (mean sequence ratio over non-empty rows),
        ``dual_clip_frac`` (always 0, for a uniform stats layout).
    """
    mask = response_mask.to(logprobs.dtype)
    old_logprobs = old_logprobs.detach()
    advantages = advantages.detach()
    lengths = mask.sum(-1)
    seq_log_ratio = ((logprobs - old_logprobs) * mask).sum(-1) / lengths.clamp(min=1.0)
    log_ratio = logprobs - logprobs.detach() + seq_log_ratio.detach().unsqueeze(-1)
    ratio = torch.exp(log_ratio.clamp(max=_MAX_SEQ_LOG_RATIO))
    loss_mat, clipped = _clipped_surrogate(ratio, advantages, clip_low, clip_high)
    if is_weights is not None:
        loss_mat = loss_mat * is_weights.detach()
    loss = aggregate_loss(
        loss_mat,
        mask,
        loss_agg_mode,
        norm_length=norm_length,
        global_tokens=global_tokens,
        global_seqs=global_seqs,
    )
    with torch.no_grad():
        seq_valid = (lengths > 0).to(mask.dtype)
        stats = {
            "clipfrac": _masked_mean(clipped.to(mask.dtype), mask),
            "approx_kl": _masked_mean(-(logprobs.detach() - old_logprobs), mask),
            "ratio_mean": _masked_mean(
                torch.exp(seq_log_ratio.detach().clamp(max=_MAX_SEQ_LOG_RATIO)), seq_valid
            ),
            "dual_clip_frac": torch.zeros((), dtype=mask.dtype, device=mask.device),
        }
    return loss, stats


def actor_policy_loss(
    policy_loss: str,
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_low: float,
    clip_high: float,
    clip_ratio_c: float,
    loss_agg_mode: str,
    is_weights: torch.Tensor | None = None,
    **agg: Any,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """`actor.policy_loss` with verl's conventions: ``vanilla`` (and its alias ``dual_clip``) is the clipped
    surrogate with the dual clip on negative advantages; ``gspo`` aggregates seq-mean-token-mean whatever
    `loss_agg_mode` says."""
    if policy_loss == "gspo":
        return gspo_loss(
            logprobs,
            old_logprobs,
            advantages,
            response_mask,
            clip_low,
            clip_high,
            GSPO_LOSS_AGG_MODE,
            is_weights,
            **agg,
        )
    if policy_loss in ("vanilla", "dual_clip"):
        return ppo_clip_loss(
            logprobs,
            old_logprobs,
            advantages,
            response_mask,
            clip_low,
            clip_high,
            clip_ratio_c,
            loss_agg_mode,
            is_weights,
            **agg,
        )
    raise ValueError(f"unknown policy_loss {policy_loss!r}; expected vanilla, dual_clip or gspo")


@torch.no_grad()
def truncated_is_weights(
    old_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    cap: float = 2.0,
    level: str = "token",
) -> torch.Tensor:
    """Truncated importance weights ``min(pi_old / mu, cap)`` correcting for the behaviour policy ``mu``.

    The rollout engine's log-probs (``mu``: a stale policy version, or a different kernel) differ from the
    trainer's; truncation (TIS) bounds the variance. ``level="token"`` weighs each token by its own ratio;
    ``level="sequence"`` uses the product of the sequence's token ratios on all its tokens.

    Args:
        old_logprobs: [B, T] trainer log-probs of the policy the advantages belong to.
        behaviour_logprobs: [B, T] log-probs recorded by the rollout engine.
        response_mask: [B, T].

    Returns:
        [B, T] detached weights, 0 on padding.
    """
    if cap <= 0:
        raise ValueError(f"cap must be positive, got {cap}")
    mask = response_mask.to(old_logprobs.dtype)
    log_ratio = (old_logprobs.detach() - behaviour_logprobs.detach()) * mask
    if level == "sequence":
        log_ratio = log_ratio.sum(-1, keepdim=True).expand_as(mask)
    elif level != "token":
        raise ValueError(f"unknown IS level {level!r}; expected 'token' or 'sequence'")
    # min(exp(x), cap) == exp(min(x, log cap)), which cannot overflow.
    return torch.exp(log_ratio.clamp(max=math.log(cap))) * mask


def user_policy_loss(
    fn: Callable[..., Any],
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str,
    config: Any,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A policy loss named by import path (``actor.policy_loss=pkg.mod:fn``), called as verl calls its
    registered ones: ``fn(old_log_prob=, log_prob=, advantages=, response_mask=, loss_agg_mode=,
    config=<the actor section>, rollout_is_weights=)``. It may return the loss, ``(loss, {metric: value})``
    or verl's older ``(loss, clipfrac, ppo_kl, clipfrac_lower)``; the metrics are reported under
    ``actor/``."""
    out = fn(
        old_log_prob=old_logprobs,
        log_prob=logprobs,
        advantages=advantages,
        response_mask=response_mask,
        loss_agg_mode=loss_agg_mode,
        config=config,
        rollout_is_weights=is_weights,
    )
    stats: dict[str, torch.Tensor] = {}
    if isinstance(out, torch.Tensor):
        loss = out
    elif isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], dict):
        loss, stats = out[0], {k: torch.as_tensor(v).detach().float() for k, v in out[1].items()}
    elif isinstance(out, tuple) and len(out) == 4:
        loss = out[0]
        names = ("pg_clipfrac", "ppo_kl", "pg_clipfrac_lower")
        stats = {k: torch.as_tensor(v).detach().float() for k, v in zip(names, out[1:], strict=True)}
    else:
        raise TypeError(f"policy loss {fn.__name__} returned {type(out).__name__}; expected a loss tensor")
    if not (
        isinstance(loss, torch.Tensor) and loss.dim() == 0 and loss.requires_grad == logprobs.requires_grad
    ):
        raise TypeError(f"policy loss {fn.__name__} must return a scalar tensor that carries the gradient")
    return loss, stats
