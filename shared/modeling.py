"""Model loading and the ONE way log-probs are computed (learner, ref service and every engine use this).

Log-prob convention (see rlbus.rollout.engines.base): the log-prob of token t is
log_softmax(logits / T) over the full vocabulary, gathered at t, computed in float32, with T = 1 when
the temperature is 0 (greedy). logits[:, i] predict input_ids[:, i + 1].

Batches are RIGHT padded and position ids come from the attention mask. Real tokens then sit at
positions 0..n-1, exactly where a left-padded `generate` (which also derives positions from the mask)
put them, so recomputed log-probs match the behaviour log-probs of generation. Right padding also means
no query row is fully masked (pad queries still see the real keys before them), which keeps sdpa free
of NaN rows, and a response occupies one contiguous span starting at the prompt's length.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, cast, overload

import numpy as np
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
)

from rlbus.chunked_logprobs import DEFAULT_CHUNK_TOKENS, logprob_head, supports_chunked_head

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}
_GENERIC_TOKENIZER_CLASSES = {"TokenizersBackend", "PreTrainedTokenizerFast"}


def torch_dtype(name: str) -> torch.dtype:
    """Config dtype name -> torch dtype; raises on an unknown name rather than silently using fp32."""
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; expected one of {sorted(_DTYPES)}") from None


def pick_device(pref: str = "auto") -> torch.device:
    """'auto' -> cuda when available else cpu; anything else is taken literally (e.g. 'cuda:1')."""
    if pref == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(pref)


def effective_temperature(temperature: float) -> float:
    """Greedy (T = 0) records log-probs at T = 1, per the engine convention."""
    return 1.0 if temperature is None or temperature <= 0 else float(temperature)


def model_vocab_size(path: str | Path, trust_remote_code: bool = False) -> int:
    """The embedding's row count of the checkpoint at `path`: a token id at or past it crashes a forward."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    return int(getattr(config, "get_text_config", lambda: config)().vocab_size)


def load_tokenizer(path: str | Path, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    """AutoTokenizer from a local dir; pad falls back to eos because batching needs some pad id."""
    path = Path(path)
    tok_config = path / "tokenizer_config.json"
    hub_class = json.loads(tok_config.read_text()).get("tokenizer_class") if tok_config.is_file() else None
    if hub_class in _GENERIC_TOKENIZER_CLASSES and (path / "tokenizer.json").is_file():
        # transformers 5 maps some model types (qwen2, ...) to their own tokenizer class, which rebuilds
        # the pre-tokenizer/decoder and ignores a custom tokenizer.json; a generic class means "use the file".
        tok = PreTrainedTokenizerFast.from_pretrained(str(path))
    else:
        tok = AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    if tok.pad_token_id is None:
        if tok.eos_token is None:
            raise ValueError(f"tokenizer at {path} has neither a pad nor an eos token")
        tok.pad_token = tok.eos_token
    return tok


def load_causal_lm(
    path: str | Path,
    dtype: str = "float32",
    device: torch.device | str = "cpu",
    trainable: bool = False,
    attn_implementation: str = "sdpa",
    trust_remote_code: bool = False,
) -> PreTrainedModel:
    """AutoModelForCausalLM from a local dir, in train mode (grads on) or eval mode (grads off).

    sdpa by default (fast, and exact in fp32); pass 'eager' to compare against the reference kernel.
    """
    model = AutoModelForCausalLM.from_pretrained(
        str(path),
        dtype=torch_dtype(dtype),
        attn_implementation=attn_implementation,
        trust_remote_code=trust_remote_code,
    )
    cast(Any, model).to(device if isinstance(device, torch.device) else torch.device(device))
    if trainable:
        model.train()
    else:
        model.eval()
        model.requires_grad_(False)
    return model


def round_up(n: int, multiple: int) -> int:
    """`n` rounded up to a multiple of `multiple` (a padded length)."""
    return -(-n // multiple) * multiple


def pad_batch(
    prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], pad_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """prompt+response per row, RIGHT padded to the longest row (see the module docstring for why).

    Returns input_ids [B, L], attention_mask [B, L], position_ids [B, L] (from the mask) and
    response_mask [B, L-1], aligned with `token_logprobs`' output: response_mask[b, i] is 1 when
    input_ids[b, i + 1] is a response token.
    """
    if len(prompts) != len(responses):
        raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
    if not prompts:
        raise ValueError("empty batch")
    lengths = [len(p) + len(r) for p, r in zip(prompts, responses, strict=True)]
    width = max(max(lengths), 2)  # at least one predicted position
    batch = len(prompts)
    # numpy rows, one torch conversion at the end: a torch.tensor per row cost the learner ~3 ms a step
    input_ids = np.full((batch, width), int(pad_id), dtype=np.int64)
    attention_mask = np.zeros((batch, width), dtype=np.int64)
    response_mask = np.zeros((batch, width - 1), dtype=np.int64)
    for b, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        if not len(p):
            raise ValueError(f"row {b}: empty prompt (the first response token needs a context)")
        n = len(p) + len(r)
        input_ids[b, : len(p)] = p
        input_ids[b, len(p) : n] = r
        attention_mask[b, :n] = 1
        response_mask[b, len(p) - 1 : n - 1] = 1
    attention = torch.from_numpy(attention_mask)
    return (
        torch.from_numpy(input_ids),
        attention,
        positions_from_mask(attention),
        torch.from_numpy(response_mask),
    )


def positions_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """cumsum(mask) - 1 with pads at 0: the same rule `generate` uses, so any padding side agrees."""
    pos = attention_mask.long().cumsum(-1) - 1
    return pos.masked_fill(attention_mask == 0, 0)


@overload
def token_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor,
    temperature: float = 1.0,
    return_entropy: Literal[False] = False,
    chunk_tokens: int = ...,
    positions: torch.Tensor | None = None,
    **attention_kwargs: Any,
) -> torch.Tensor: ...


@overload
def token_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor,
    temperature: float = 1.0,
    *,
    return_entropy: Literal[True],
    chunk_tokens: int = ...,
    positions: torch.Tensor | None = None,
    **attention_kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]: ...


@overload
def token_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor,
    temperature: float = 1.0,
    return_entropy: bool = ...,
    chunk_tokens: int = ...,
    positions: torch.Tensor | None = None,
    **attention_kwargs: Any,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]: ...


def token_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor,
    temperature: float = 1.0,
    return_entropy: bool = False,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    positions: torch.Tensor | None = None,
    **attention_kwargs: Any,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of each next token, [B, L-1] float32 (differentiable when the model is).

    ``attention_kwargs`` go to the model's attention (e.g. a packed row's ``cu_seq_lens_q``).

    With return_entropy, also the entropy of each position's tempered distribution, [B, L-1].
    ``chunk_tokens`` > 0 (and a plain linear output layer): the output projection and softmax run that many
    tokens at a time, so no ``tokens x vocab`` fp32 logits exist (rlbus.chunked_logprobs); 0: full logits.
    ``positions`` (bool [B, L-1], chunked path): the positions whose values are needed; the rest may read 0.
    """
    temp = effective_temperature(temperature)
    if chunk_tokens > 0 and supports_chunked_head(model):
        with logprob_head(model, input_ids, temp, chunk_tokens, positions):
            out = model(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                use_cache=False,
                **attention_kwargs,
            )
        logprobs, entropy = out.logits.unbind(-1)
        return (logprobs, entropy) if return_entropy else logprobs
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        use_cache=False,
        **attention_kwargs,
    )
    logits = out.logits[:, :-1].float()
    if temp != 1.0:
        logits = logits / temp
    logp_all = torch.log_softmax(logits, dim=-1)
    logprobs = logp_all.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    if not return_entropy:
        return logprobs
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logprobs, entropy


@torch.no_grad()
def response_logprobs(
    model: torch.nn.Module,
    prompts: list[list[int]],
    responses: list[list[int]],
    pad_id: int,
    temperature: float = 1.0,
    micro_batch_size: int = 8,
) -> list[np.ndarray]:
    """Per-sample float32 arrays of exactly len(response) log-probs (ref service, engine `score`, checks)."""
    if len(prompts) != len(responses):
        raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
    device = next(model.parameters()).device
    result: list[np.ndarray] = []
    step = max(1, int(micro_batch_size))
    for start in range(0, len(prompts), step):
        ps, rs = prompts[start : start + step], responses[start : start + step]
        ids, mask, pos, resp = pad_batch(ps, rs, pad_id)
        lp = token_logprobs(
            model,
            ids.to(device),
            mask.to(device),
            pos.to(device),
            temperature,
            positions=resp.bool().to(device),
        )
        rows = lp.cpu().numpy().astype(np.float32)
        for b, (p, r) in enumerate(zip(ps, rs, strict=True)):
            result.append(rows[b, len(p) - 1 : len(p) - 1 + len(r)].copy())
    return result


# Below this many parameters a training or decode step runs in milliseconds eager, so torch.compile's start-up
# is never won back: on an H100 (2026-12-05) the bundled 0.3M demo model spent 17.5 s compiling its decode
# step and 32.3 s its learner layers before step 1, then ran steps of a few ms either way.
COMPILE_MIN_PARAMETERS = 10_000_000


def compile_pays(parameters: int) -> bool:
    """Whether compiling a model of `parameters` can pay for its start-up (the default when none is set)."""
    return parameters >= COMPILE_MIN_PARAMETERS


def parameter_count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
