"""Advantage estimators: GRPO, Dr.GRPO, RLOO, REINFORCE++ and GAE.

Every function is a pure function of tensors, runs under ``torch.no_grad`` and returns detached tensors:
advantages are targets of the policy gradient, never something to differentiate through.
Token tensors are ``[B, T]`` with ``response_mask`` 1 on response tokens and 0 on padding; outputs are
0 on padding.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = [
    "ESTIMATORS",
    "compute_advantages",
    "dr_grpo_advantages",
    "gae_advantages",
    "grpo_advantages",
    "masked_mean",
    "masked_whiten",
    "reinforce_plus_plus_advantages",
    "rloo_advantages",
    "sequence_to_token_rewards",
    "user_advantages",
]


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``values`` over the entries where ``mask`` is 1 (0 when the mask is empty)."""
    mask = mask.to(values.dtype)
    return (values * mask).sum() / mask.sum().clamp(min=1.0)


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Shift to zero mean and scale to unit (unbiased) variance over the masked entries; 0 elsewhere.

    Matches verl's ``masked_whiten``: ``(x - mean) / sqrt(var + eps)`` with Bessel's correction, so a single
    valid entry (or all-equal entries) whitens to 0 instead of NaN.
    """
    mask = mask.to(values.dtype)
    n = mask.sum()
    mean = (values * mask).sum() / n.clamp(min=1.0)
    centred = (values - mean) * mask
    var = (centred**2).sum() / (n - 1.0).clamp(min=1.0)
    return centred * torch.rsqrt(var + eps)


def _group_index(group_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Map arbitrary (non-contiguous) group ids to 0..G-1 so groups can be reduced with index_add."""
    _, inverse = torch.unique(group_ids, return_inverse=True)
    return inverse, int(inverse.max().item()) + 1 if inverse.numel() else 0


def _group_sum_count(values: torch.Tensor, group_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample sum and size of the sample's own group (both shape [B])."""
    inverse, n_groups = _group_index(group_ids)
    sums = values.new_zeros(n_groups).index_add_(0, inverse, values)
    counts = values.new_zeros(n_groups).index_add_(0, inverse, torch.ones_like(values))
    return sums[inverse], counts[inverse]


def _check_group_inputs(rewards: torch.Tensor, group_ids: torch.Tensor, response_mask: torch.Tensor) -> None:
    if rewards.dim() != 1 or group_ids.shape != rewards.shape:
        raise ValueError(
            f"rewards and group_ids must both be [B], got {tuple(rewards.shape)} and {tuple(group_ids.shape)}"
        )
    if response_mask.dim() != 2 or response_mask.shape[0] != rewards.shape[0]:
        raise ValueError(
            f"response_mask must be [B, T] with B={rewards.shape[0]}, got {tuple(response_mask.shape)}"
        )


def _float(t: torch.Tensor) -> torch.Tensor:
    return t.detach() if t.is_floating_point() else t.detach().float()


@torch.no_grad()
def grpo_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    response_mask: torch.Tensor,
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """GRPO outcome advantage ``(r - mean_group) / (std_group + eps)`` broadcast over response tokens.

    The std is the unbiased one (``torch.std``, as verl). A group of size 1 has no baseline and gets
    advantage 0 (its own mean); a group whose rewards are all equal also gets 0.

    Args:
        rewards: [B] sequence scores.
        group_ids: [B] long; samples of one prompt share an id (groups need not be contiguous).
        response_mask: [B, T].

    Returns:
        [B, T] advantages, 0 on padding.
    """
    _check_group_inputs(rewards, group_ids, response_mask)
    rewards = _float(rewards)
    # Group statistics in float64: a float32 sum of equal rewards rounds, so an all-equal group would get a
    # small nonzero advantage of one sign (then blown up by 1 / (std + eps)); in float64 the sum of float32
    # values is exact enough that such a group's mean equals its rewards and the advantage is exactly 0.
    r64 = rewards.double()
    sums, counts = _group_sum_count(r64, group_ids)
    centred = r64 - sums / counts
    if norm_by_std:
        sq_sums, _ = _group_sum_count(centred**2, group_ids)
        std = torch.sqrt(sq_sums / (counts - 1.0).clamp(min=1.0))
        centred = centred / (std + eps)
    return centred.to(rewards.dtype).unsqueeze(-1) * response_mask.to(rewards.dtype)


@torch.no_grad()
def dr_grpo_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    response_mask: torch.Tensor,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Dr.GRPO advantage: ``r - mean_group``, no std division (which biases towards easy/hard prompts).

    The length-bias half of Dr.GRPO is the ``seq-mean-token-sum-norm`` loss aggregation, not this function.
    ``eps`` is accepted for a uniform signature and unused.
    """
    del eps
    return grpo_advantages(rewards, group_ids, response_mask, norm_by_std=False)


@torch.no_grad()
def rloo_advantages(
    rewards: torch.Tensor, group_ids: torch.Tensor, response_mask: torch.Tensor
) -> torch.Tensor:
    """RLOO advantage ``r_i - mean_{j != i} r_j``: each sample's baseline excludes itself, so it is unbiased.

    A group of size 1 has no other sample and gets 0.

    Returns:
        [B, T] advantages, 0 on padding.
    """
    _check_group_inputs(rewards, group_ids, response_mask)
    rewards = _float(rewards)
    r64 = rewards.double()  # as in GRPO: an all-equal group's advantages are exactly 0
    sums, counts = _group_sum_count(r64, group_ids)
    others = counts - 1.0
    baseline = (sums - r64) / others.clamp(min=1.0)
    adv = torch.where(others > 0, r64 - baseline, torch.zeros_like(r64))
    return adv.to(rewards.dtype).unsqueeze(-1) * response_mask.to(rewards.dtype)


def _discounted_returns(token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """Returns-to-go over valid tokens; masked tokens are skipped (the return passes through them unchanged)."""
    returns = torch.zeros_like(token_rewards)
    running = token_rewards.new_zeros(token_rewards.shape[0])
    for t in range(token_rewards.shape[1] - 1, -1, -1):
        m = mask[:, t]
        running = m * (token_rewards[:, t] + gamma * running) + (1.0 - m) * running
        returns[:, t] = running * m
    return returns


@torch.no_grad()
def reinforce_plus_plus_advantages(
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float = 1.0,
    eps: float = 1e-8,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++: discounted returns-to-go per token, whitened over all valid tokens of the batch.

    The global (batch) whitening is REINFORCE++'s replacement for a critic or a group baseline. Rewards on
    padding are ignored; a masked gap inside a response (e.g. tool output in a multi-turn trajectory) is
    skipped without discounting.

    Args:
        token_rewards: [B, T] per-token rewards (see ``sequence_to_token_rewards``).
        response_mask: [B, T].

    Returns:
        (advantages [B, T] whitened, returns [B, T] unwhitened returns-to-go); both 0 on padding.
    """
    mask = response_mask.to(_float(token_rewards).dtype)
    returns = _discounted_returns(_float(token_rewards) * mask, mask, gamma)
    return masked_whiten(returns, mask, eps), returns


@torch.no_grad()
def gae_advantages(
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float = 1.0,
    lam: float = 1.0,
    eps: float = 1e-8,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over valid tokens (PPO with a critic).

    ``delta_t = r_t + gamma * V_{t+1} - V_t`` and ``A_t = delta_t + gamma * lam * A_{t+1}``, where "t+1" is
    the next *valid* token and the value beyond the last valid token is 0 (the episode ends). Masked tokens
    are skipped, so padding values never leak in and multi-turn gaps pass through.

    Args:
        token_rewards: [B, T].
        values: [B, T] critic values of the (old) policy.
        response_mask: [B, T].

    Returns:
        (advantages [B, T] whitened over the mask, returns [B, T] = unwhitened advantages + values);
        both 0 on padding.
    """
    rewards = _float(token_rewards)
    values = _float(values).to(rewards.dtype)
    mask = response_mask.to(rewards.dtype)
    rewards = rewards * mask
    adv = torch.zeros_like(rewards)
    next_value = rewards.new_zeros(rewards.shape[0])
    last_gae = rewards.new_zeros(rewards.shape[0])
    for t in range(rewards.shape[1] - 1, -1, -1):
        m = mask[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        gae_t = delta + gamma * lam * last_gae
        next_value = m * values[:, t] + (1.0 - m) * next_value
        last_gae = m * gae_t + (1.0 - m) * last_gae
        adv[:, t] = gae_t * m
    returns = (adv + values) * mask
    return masked_whiten(adv, mask, eps), returns


@torch.no_grad()
def sequence_to_token_rewards(
    rewards: torch.Tensor,
    response_mask: torch.Tensor,
    kl: torch.Tensor | None = None,
    kl_coef: float = 0.0,
) -> torch.Tensor:
    """Place each sequence score on its last valid token and subtract ``kl_coef * kl`` on every valid token.

    This is the "KL in reward" form used by PPO/REINFORCE++ (as opposed to a KL term in the loss).
    A row with no valid token gets all zeros.

    Args:
        rewards: [B] sequence scores.
        response_mask: [B, T].
        kl: optional [B, T] per-token KL estimate (see ``kl.kl_estimate``).

    Returns:
        [B, T] token rewards, 0 on padding.
    """
    rewards = _float(rewards)
    mask = response_mask.to(rewards.dtype)
    B, T = mask.shape
    positions = torch.arange(T, device=mask.device).expand(B, T)
    last = torch.where(mask > 0, positions, torch.full_like(positions, -1)).max(dim=1).values
    has_token = last >= 0
    token_rewards = torch.zeros_like(mask)
    rows = torch.arange(B, device=mask.device)[has_token]
    token_rewards[rows, last[has_token]] = rewards[has_token]
    if kl is not None and kl_coef != 0.0:
        token_rewards = token_rewards - kl_coef * _float(kl).to(mask.dtype) * mask
    return token_rewards


ESTIMATORS = ("grpo", "dr_grpo", "rloo", "reinforce_plus_plus", "gae")


def compute_advantages(
    estimator: str,
    *,
    response_mask: torch.Tensor,
    rewards: torch.Tensor | None = None,
    group_ids: torch.Tensor | None = None,
    token_rewards: torch.Tensor | None = None,
    values: torch.Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    norm_by_std: bool = True,
    eps: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dispatch to an estimator by its config name, so the learner's loop does not branch on algorithms.

    Group estimators (``grpo``, ``dr_grpo``, ``rloo``) need ``rewards`` [B] (or ``token_rewards``, summed per
    row) and ``group_ids``; ``reinforce_plus_plus`` and ``gae`` need ``token_rewards`` [B, T] (or ``rewards``,
    placed on the last token); ``gae`` also needs ``values``.

    ``eps`` (None: each estimator's default) is the std epsilon for ``grpo`` and the variance epsilon of
    the whitening for ``reinforce_plus_plus``/``gae``.

    Returns:
        (advantages [B, T], returns [B, T]); for group estimators returns equal the advantages (as verl).
    """
    kw = {} if eps is None else {"eps": eps}
    name = estimator.lower().replace("-", "_")
    if name in ("grpo", "dr_grpo", "rloo"):
        if group_ids is None:
            raise ValueError(f"estimator {estimator!r} needs group_ids")
        if rewards is None:
            if token_rewards is None:
                raise ValueError(f"estimator {estimator!r} needs rewards or token_rewards")
            rewards = (token_rewards * response_mask.to(token_rewards.dtype)).sum(-1)
        if name == "grpo":
            adv = grpo_advantages(rewards, group_ids, response_mask, norm_by_std=norm_by_std, **kw)
        elif name == "dr_grpo":
            adv = dr_grpo_advantages(rewards, group_ids, response_mask)
        else:
            adv = rloo_advantages(rewards, group_ids, response_mask)
        return adv, adv
    if name in ("reinforce_plus_plus", "gae"):
        if token_rewards is None:
            if rewards is None:
                raise ValueError(f"estimator {estimator!r} needs token_rewards or rewards")
            token_rewards = sequence_to_token_rewards(rewards, response_mask)
        if name == "reinforce_plus_plus":
            return reinforce_plus_plus_advantages(token_rewards, response_mask, gamma=gamma, **kw)
        if values is None:
            raise ValueError("estimator 'gae' needs values from a critic")
        return gae_advantages(token_rewards, values, response_mask, gamma=gamma, lam=lam, **kw)
    raise ValueError(f"unknown advantage estimator {estimator!r}; expected one of {ESTIMATORS}")


@torch.no_grad()
def user_advantages(
    fn: Callable[..., Any],
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: torch.Tensor,
    config: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """An estimator named by import path (``algorithm.adv_estimator=pkg.mod:fn``), called as verl calls its
    registered ones: ``fn(token_level_rewards=[B, T], response_mask=[B, T], index=<group id per row>,
    config=<the algorithm section>)`` -> ``(advantages [B, T], returns [B, T])``."""
    out = fn(
        token_level_rewards=token_rewards,
        response_mask=response_mask,
        index=group_ids.cpu().numpy(),
        config=config,
    )
    if not (isinstance(out, tuple) and len(out) == 2):
        raise TypeError(f"advantage estimator {fn.__name__} must return (advantages, returns)")
    advantages, returns = (torch.as_tensor(t, dtype=torch.float32) for t in out)
    for name, t in (("advantages", advantages), ("returns", returns)):
        if t.shape != response_mask.shape:
            raise ValueError(
                f"advantage estimator {fn.__name__}: {name} {tuple(t.shape)} != {tuple(response_mask.shape)}"
            )
    return advantages * response_mask, returns * response_mask
