"""What the learner checks in a `ReadyGroup` before it goes into a batch.

Schema validation (rlbus.messages) only says a message is well formed. Fewer rewards than samples, log-probs
shorter than their response, a token id past the embedding or a NaN log-prob are well formed too: in
collate they crash the learner (every crash a restart plus retraining) or, worse, train on a silent
broadcast; a NaN made the whole step skip its update, so the honest groups of that batch lost theirs.
Such a group is dead-lettered alone with the reason, and its prompt is dispatched again.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from rlbus.config import RlbusConfig
from rlbus.messages import ReadyGroup

# A prompt's tokens include what the chat template adds around data.max_prompt_length of text tokens.
TEMPLATE_ALLOWANCE_TOKENS = 512


@dataclass(frozen=True)
class ReadyLimits:
    """The run's bounds on what a trainable group may hold."""

    run_id: str
    vocab_size: int
    max_prompt_tokens: int
    max_response_tokens: int
    train_samples: int  # rollout.n: every train group has exactly this many samples
    needs_ref: bool  # a KL term reads reference log-probs


def ready_limits(cfg: RlbusConfig, vocab_size: int) -> ReadyLimits:
    return ReadyLimits(
        run_id=cfg.run.id,
        vocab_size=vocab_size,
        max_prompt_tokens=cfg.data.max_prompt_length + TEMPLATE_ALLOWANCE_TOKENS,
        max_response_tokens=cfg.data.max_response_length,
        train_samples=cfg.rollout.n,
        needs_ref=cfg.needs_ref,
    )


def _token_problem(ids: Sequence[int], vocab_size: int, what: str) -> str | None:
    if not ids:
        return None
    arr = np.asarray(ids, dtype=np.int64)
    low, high = int(arr.min()), int(arr.max())
    if low < 0 or high >= vocab_size:
        bad = high if high >= vocab_size else low
        return f"{what} token id {bad} is outside the vocabulary [0, {vocab_size})"
    return None


def _logprob_problem(values: np.ndarray, length: int, what: str) -> str | None:
    if values.shape != (length,):
        return f"{what} has {values.shape[0]} log-probs for {length} response tokens"
    if not np.isfinite(values).all():
        return f"{what} has a non-finite log-prob"
    return None


def rejection(group: ReadyGroup, limits: ReadyLimits, dispatched_index: int | None) -> str | None:
    """Why the learner must not train on `group`, or None when it may.

    `dispatched_index`: the data index the learner dispatched this prompt id with (None: validation work,
    whose index is its record number).
    """
    scored = group.scored
    traj = scored.trajectories
    work = traj.work
    if work.run_id != limits.run_id:
        return f"run id {work.run_id!r} is not this run's {limits.run_id!r}"
    if dispatched_index is not None and work.index != dispatched_index:
        return f"data index {work.index} is not the {dispatched_index} this prompt id was dispatched with"
    n = len(traj.samples)
    want = limits.train_samples if work.split == "train" else 1
    if n != want or work.n != want:
        return f"{n} samples (work.n={work.n}) where the run makes {want}"
    if len(scored.rewards) != n or len(scored.correct) != n:
        return f"{len(scored.rewards)} rewards and {len(scored.correct)} correct flags for {n} samples"
    if scored.reward_errors and len(scored.reward_errors) != n:
        return f"{len(scored.reward_errors)} reward errors for {n} samples"
    if not all(math.isfinite(r) for r in scored.rewards):
        return "a reward is not finite"
    if not work.prompt_ids:
        return "empty prompt"
    if len(work.prompt_ids) > limits.max_prompt_tokens:
        return (
            f"prompt of {len(work.prompt_ids)} tokens is over the run's limit of {limits.max_prompt_tokens}"
        )
    problem = _token_problem(work.prompt_ids, limits.vocab_size, "prompt")
    if problem:
        return problem
    if limits.needs_ref and group.ref_logprobs is None:
        return "no reference log-probs, and a KL term of this run needs them"
    if group.ref_logprobs is not None and len(group.ref_logprobs) != n:
        return f"{len(group.ref_logprobs)} reference log-prob rows for {n} samples"
    for i, sample in enumerate(traj.samples):
        length = len(sample.response_ids)
        if length > limits.max_response_tokens:
            return f"sample {i}: {length} response tokens is over data.max_response_length={limits.max_response_tokens}"
        problem = (
            _token_problem(sample.response_ids, limits.vocab_size, f"sample {i}: response")
            or _logprob_problem(sample.logprobs, length, f"sample {i}")
            or (
                _logprob_problem(group.ref_logprobs[i], length, f"sample {i}: reference")
                if group.ref_logprobs is not None
                else None
            )
        )
        if problem:
            return problem
    return None
