"""DAPO pieces that act on rewards: dynamic-sampling group filter and soft overlong punishment."""

from __future__ import annotations

import torch

__all__ = ["groups_with_reward_variance", "overlong_penalty"]


def groups_with_reward_variance(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """Which samples belong to a group whose rewards are not all equal (DAPO dynamic sampling).

    A group with equal rewards (all solved, all failed, or a single sample) has zero group-relative
    advantage and gives no gradient, so it is filtered out and more prompts are sampled.

    Args:
        rewards: [B].
        group_ids: [B] long; groups need not be contiguous.

    Returns:
        [B] bool, True for samples to keep.
    """
    if rewards.numel() == 0:
        return torch.zeros(0, dtype=torch.bool, device=rewards.device)
    rewards = rewards.detach() if rewards.is_floating_point() else rewards.detach().float()
    _, inverse = torch.unique(group_ids, return_inverse=True)
    n_groups = int(inverse.max().item()) + 1
    g_max = rewards.new_full((n_groups,), float("-inf")).scatter_reduce(0, inverse, rewards, reduce="amax")
    g_min = rewards.new_full((n_groups,), float("inf")).scatter_reduce(0, inverse, rewards, reduce="amin")
    return (g_max > g_min)[inverse]


def overlong_penalty(
    response_lengths: torch.Tensor,
    max_response_length: int,
    overlong_buffer_len: int,
    penalty_factor: float = 1.0,
) -> torch.Tensor:
    """DAPO soft overlong punishment, added to the reward.

    0 while ``len <= max - buffer``, then linear down to ``-penalty_factor`` at ``len == max``, and
    ``-penalty_factor`` beyond; a graded signal instead of a cliff at truncation. ``overlong_buffer_len=0``
    is a hard penalty for ``len > max``.

    Args:
        response_lengths: [B] number of response tokens per sample.

    Returns:
        [B] float penalties (<= 0).
    """
    if overlong_buffer_len < 0 or overlong_buffer_len > max_response_length:
        raise ValueError(
            f"overlong_buffer_len must be in [0, {max_response_length}], got {overlong_buffer_len}"
        )
    lengths = response_lengths.detach().to(torch.float32)
    if overlong_buffer_len == 0:
        return (lengths > max_response_length).to(torch.float32) * -float(penalty_factor)
    expected = max_response_length - overlong_buffer_len
    exceed = (lengths - expected).clamp(min=0.0, max=float(overlong_buffer_len))
    return -exceed / overlong_buffer_len * penalty_factor
