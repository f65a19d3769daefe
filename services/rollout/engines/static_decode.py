"""The embedded engine's own decode loop on a row bucket's static KV cache: no host sync per token.

transformers' `generate` checks its stopping criteria on the host after every token, and with
`output_logits=True` keeps every step's [rows, vocab] float32 logits until the end (40 GB for 512 rows x 128
tokens on a 152k vocabulary). This loop prefills eagerly, then runs the model's decode step (compiled by
transformers' `get_compiled_call`, or recorded as a CUDA graph: `make_decode_step`) at one fixed shape per
bucket, picks tokens on the device and keeps only the sampled token's log-prob. The host looks at the rows
every `CHECK_EVERY` tokens, to stop once all of them have ended.

Log-probs follow the engine's convention (module doc of `hf.py`): log_softmax(raw logits / T) at the
sampled token, in float32; top-k/top-p only narrow what is sampled.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, get_args

import numpy as np
import torch
from transformers import CompileConfig, StaticCache

from rlbus.messages import SamplingParams
from rlbus.modeling import effective_temperature

Picker = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]  # logits -> (tokens, log-probs)
CHECK_EVERY = 16  # tokens between the host's looks at whether every row has ended (each look syncs)
# From this vocabulary up the sampler is compiled: the eager path's [rows, vocab] float32 passes cost more
# than a compile of a few seconds at start. Below it (toy and character tokenizers) they cost microseconds.
SAMPLER_COMPILE_MIN_VOCAB = 32_000


def sampler_compile_pays(vocab: int) -> bool:
    """Whether the sampler is worth compiling beside the decode step for a vocabulary of `vocab` tokens."""
    return vocab >= SAMPLER_COMPILE_MIN_VOCAB


@dataclass
class Decoded:
    """Sampled tokens and their log-probs, [rows, steps] on the host (ended rows padded after their end)."""

    tokens: list[list[int]]
    logprobs: np.ndarray  # float32 [rows, steps]


def pick_tokens(logits: torch.Tensor, sp: SamplingParams, banned: torch.Tensor | None) -> torch.Tensor:
    """Next tokens from float32 logits [rows, vocab]: greedy at temperature 0, else sampled after temperature,
    top-k and top-p, with an exponential race (argmax of p / E, E ~ Exp(1): a draw from p without a sync)."""
    if banned is not None:
        logits = logits.index_fill(-1, banned, float("-inf"))
    if sp.temperature <= 0:
        return logits.argmax(-1)
    scores = logits / sp.temperature
    if 0 < sp.top_k < scores.shape[-1]:
        kth = scores.topk(sp.top_k, dim=-1).values[:, -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if sp.top_p < 1.0:
        sorted_scores, order = scores.sort(dim=-1, descending=True)
        probs = sorted_scores.softmax(-1)
        drop = probs.cumsum(-1) - probs > sp.top_p  # keep the smallest prefix whose mass reaches top_p
        scores = scores.scatter(-1, order, sorted_scores.masked_fill(drop, float("-inf")))
    probs = scores.softmax(-1)
    return (probs / torch.empty_like(probs).exponential_(1)).argmax(-1)


def sample_tokens(
    logits: torch.Tensor, inv_temperature: torch.Tensor, noise: torch.Tensor, bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Next tokens and their log-probs from one step's logits [rows, vocab], without top-k/top-p: the token is
    the argmax of logits / T + `bias` + Gumbel noise x `noise` (Gumbel-max: a draw from the softmax, the
    exponential race of `pick_tokens` in log space; `noise` 0 is greedy), its log-prob log_softmax(logits / T)
    at it, the engine's convention (`bias` -inf bans a token from the draw, not from the log-prob). Compiled,
    it reads the logits in a pass or two, where the eager steps of `pick_tokens` and the log-softmax wrote and
    read [rows, vocab] float32 copies about ten times a token (a 152k vocabulary at 512 rows: 311 MB each)."""
    scaled = logits.float() * inv_temperature
    log_normaliser = torch.logsumexp(scaled, dim=-1)
    exponential = torch.empty_like(scaled).exponential_().clamp_min_(torch.finfo(torch.float32).tiny)
    token = (scaled + bias - exponential.log() * noise).argmax(-1)
    return token, scaled.gather(-1, token[:, None]).squeeze(-1) - log_normaliser


DecodeStepKind = Literal["inductor", "recorded", "recorded_then_inductor"]  # rollout.decode_step
DECODE_STEP_KINDS: tuple[DecodeStepKind, ...] = get_args(DecodeStepKind)


def make_decode_step(model: Any, how: DecodeStepKind, device: torch.device) -> Callable[..., Any]:
    """The decode step a static cache runs: `inductor` compiles it (transformers' `get_compiled_call`: fused
    kernels, in CUDA graphs on a GPU; on the CPU only where tests ask), `recorded` records its eager kernels as
    a CUDA graph per shape (recorded_decode.py: no compile; a GPU only). `recorded_then_inductor` starts
    recorded (eager on the CPU: tests) until the engine takes the step compiled in the background
    (background_compile.py)."""
    if how not in DECODE_STEP_KINDS:
        raise ValueError(f"unknown decode step {how!r}: {', '.join(DECODE_STEP_KINDS)}")
    if how == "inductor":
        return model.get_compiled_call(decode_compile_config(device))
    if device.type != "cuda":
        if how == "recorded":
            raise ValueError(
                "rollout.decode_step=recorded records CUDA graphs: it needs the replica on a GPU"
            )
        return model  # eager until the compiled step is taken
    from rlbus.rollout.engines.recorded_decode import RecordedDecodeStep

    return RecordedDecodeStep(model)


def call_step(  # noqa: PLR0913
    step: Callable[..., Any],
    token: torch.Tensor,
    full_mask: torch.Tensor,
    position: torch.Tensor,
    cache: StaticCache,
    cache_position: torch.Tensor,
) -> torch.Tensor:
    """One decode step's logits [rows, vocab] for `token` [rows] at `position` [rows, 1] (its keys and values
    written at `cache_position`), the keywords as transformers' decode passes them."""
    torch.compiler.cudagraph_mark_step_begin()  # the last step's outputs are consumed: reuse them
    out = step(
        input_ids=token[:, None],
        attention_mask=full_mask,
        position_ids=position,
        past_key_values=cache,
        cache_position=cache_position,
        use_cache=True,
    )
    return out.logits[:, -1]


def exercise_decode_step(  # noqa: PLR0913
    model: Any,
    step: Callable[..., Any],
    cache: StaticCache,
    rows: int,
    cache_len: int,
    pad_id: int,
    device: torch.device,
    tokens: int = 3,
) -> None:
    """`step` run as `StaticDecoder.run` runs it at `rows` x `cache_len` (an eager prefill of one token a row,
    then `tokens` decode steps on pad tokens), with no sampler: what compiles a step for that shape."""
    width = 1
    ids = torch.full((rows, width), pad_id, dtype=torch.long, device=device)
    full_mask = torch.zeros((rows, cache_len), dtype=torch.long, device=device)
    full_mask[:, :width] = 1
    model(input_ids=ids, attention_mask=full_mask, position_ids=torch.zeros_like(ids), past_key_values=cache,
          cache_position=torch.arange(width, device=device), use_cache=True)  # fmt: skip
    next_position = full_mask.sum(-1, keepdim=True)
    cache_positions = torch.arange(width, width + tokens, device=device)
    for t in range(tokens):
        full_mask[:, width + t] = 1
        call_step(step, ids[:, 0], full_mask, next_position + t, cache, cache_positions[t : t + 1])


def decode_compile_config(device: torch.device) -> CompileConfig:
    """transformers' default (CUDA graphs on a GPU) with a static graph per batch shape (sizes as symbols
    compiled 3.2x as long and decoded 10% slower on an H100); on the CPU it compiles only when asked to
    (tests)."""
    config = CompileConfig(dynamic=False)
    if device.type != "cuda":
        setattr(config, "_compile_all_devices", True)  # noqa: B010 (transformers' private test switch)
    return config


class StaticDecoder:
    """Decodes left-padded prompts on a `StaticCache` of `cache_len` positions, one compiled (or recorded) step
    per shape."""

    def __init__(
        self, model: Any, step: Callable[..., Any] | None = None, compile_sampler: bool = False
    ) -> None:
        self.model = model
        self.step = model if step is None else step  # compiled or recorded (`make_decode_step`), or eager
        # beside the compiled step, for the same shapes (warm_up compiles both); tensors for T, the noise and
        # the bans, so greedy and sampled batches and either end-token rule share one graph per shape
        self.sample = (
            torch.compile(sample_tokens, dynamic=False, fullgraph=True) if compile_sampler else sample_tokens
        )

    def _picker(self, sp: SamplingParams, eos: torch.Tensor, vocab: int, device: torch.device) -> Picker:
        """logits [rows, vocab] -> (tokens, log-probs): `sample` on the common path, `pick_tokens` and a
        log-softmax with top-k or top-p."""
        temp = effective_temperature(sp.temperature)
        if 0 < sp.top_k < vocab or sp.top_p < 1.0:
            banned = eos if sp.ignore_eos else None

            def narrowed(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
                logits = logits.float()
                token = pick_tokens(logits, sp, banned)
                return token, (logits / temp).log_softmax(-1).gather(-1, token[:, None]).squeeze(-1)

            return narrowed
        inv_temperature = torch.tensor(1.0 / temp, device=device)
        noise = torch.tensor(1.0 if sp.temperature > 0 else 0.0, device=device)
        bias = torch.zeros(vocab, device=device)
        if sp.ignore_eos:  # as generate's min_new_tokens: an end is never drawn
            bias[eos] = float("-inf")
        return lambda logits: self.sample(logits, inv_temperature, noise, bias)

    @torch.no_grad()
    def run(  # noqa: PLR0913
        self,
        ids: torch.Tensor,
        mask: torch.Tensor,
        cache: StaticCache,
        cache_len: int,
        sp: SamplingParams,
        eos_ids: set[int],
        pad_id: int,
    ) -> Decoded:
        rows, width = ids.shape
        device = ids.device
        full_mask = torch.zeros((rows, cache_len), dtype=mask.dtype, device=device)  # the cache's length
        full_mask[:, :width] = mask
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        out = self.model(
            input_ids=ids,
            attention_mask=full_mask,
            position_ids=positions,
            past_key_values=cache,
            cache_position=torch.arange(width, device=device),
            use_cache=True,
        )
        logits = out.logits[:, -1].contiguous()  # the decode steps' layout: one sampler graph for both
        del out
        eos = torch.tensor(sorted(eos_ids), device=device)
        pick = self._picker(sp, eos, logits.shape[-1], device)
        next_position = mask.sum(-1, keepdim=True)
        tokens = torch.full((rows, sp.max_tokens), pad_id, dtype=torch.long, device=device)
        logprobs = torch.zeros((rows, sp.max_tokens), dtype=torch.float32, device=device)
        ended = torch.zeros(rows, dtype=torch.bool, device=device)
        cache_positions = torch.arange(width, width + sp.max_tokens, device=device)
        steps = 0
        for t in range(sp.max_tokens):
            token, logprob = pick(logits)
            token = torch.where(ended, pad_id, token)
            tokens[:, t] = token
            logprobs[:, t] = logprob
            steps = t + 1
            if not sp.ignore_eos:
                ended |= torch.isin(token, eos)
            if t + 1 == sp.max_tokens or ((t + 1) % CHECK_EVERY == 0 and bool(ended.all())):
                break
            full_mask[:, width + t] = 1
            logits = call_step(
                self.step, token, full_mask, next_position + t, cache, cache_positions[t : t + 1]
            )
        return Decoded(tokens[:, :steps].tolist(), logprobs[:, :steps].cpu().numpy())
