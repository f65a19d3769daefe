"""What a replica checks in a `PromptWork` before its engine sees it.

Schema validation (rlbus.messages) only says a message is well formed. A token id past the vocabulary, a
prompt longer than the run allows, or `n` in the millions is well formed too, and would crash the engine
(an out-of-range id is a device-side assert on a GPU, which poisons the whole process) or hold it for
hours. Such an item is dead-lettered alone, with the reason; its batch-mates are generated.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from rlbus.config import RlbusConfig
from rlbus.messages import PromptWork

# A prompt's tokens include what the chat template adds around data.max_prompt_length of text tokens.
TEMPLATE_ALLOWANCE_TOKENS = 512


@dataclass(frozen=True)
class RequestLimits:
    vocab_size: int
    max_prompt_tokens: int
    max_new_tokens: int
    max_samples: int


def limits_for(cfg: RlbusConfig, model_path: str | Path) -> RequestLimits:
    """The run's bounds: the model's embedding size, the configured lengths, the largest group it dispatches."""
    from rlbus.modeling import model_vocab_size

    return RequestLimits(
        vocab_size=model_vocab_size(model_path, cfg.model.trust_remote_code),
        max_prompt_tokens=cfg.data.max_prompt_length + TEMPLATE_ALLOWANCE_TOKENS,
        max_new_tokens=cfg.data.max_response_length,
        max_samples=max(cfg.rollout.n, 1),
    )


def rejection(work: PromptWork, limits: RequestLimits) -> str | None:
    """Why the engine must not take `work`, or None when it may."""
    ids = work.prompt_ids
    if not ids:
        return "empty prompt"
    if len(ids) > limits.max_prompt_tokens:
        return f"prompt of {len(ids)} tokens is over the run's limit of {limits.max_prompt_tokens}"
    low, high = min(ids), max(ids)
    if low < 0 or high >= limits.vocab_size:
        return f"token id {high if high >= limits.vocab_size else low} is outside the vocabulary [0, {limits.vocab_size})"
    if not 1 <= work.n <= limits.max_samples:
        return f"n={work.n} samples is outside [1, {limits.max_samples}] (rollout.n)"
    if not 0 <= work.sampling.max_tokens <= limits.max_new_tokens:
        return f"max_tokens={work.sampling.max_tokens} is outside [0, {limits.max_new_tokens}] (data.max_response_length)"
    return None
