"""DAPO's soft overlong punishment (its dynamic-sampling filter drops equal-reward groups as they arrive:
services/learner/service.py)."""

from __future__ import annotations

import torch

__all__ = ["overlong_penalty"]


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
