"""Token log-probs and entropies straight from the last hidden states, a chunk of tokens at a time.

The plain way (``model(...).logits.float().log_softmax(-1)``) materialises ``tokens x vocab`` logits in the
compute dtype, then again in fp32, then their softmax: at Qwen2's 151,936-entry vocabulary a 16k-token
micro-batch holds about 10 GB per copy, and reading and writing them dominates the step. Here the output
projection runs on ``chunk`` rows at a time and only four numbers per token survive the forward (log-prob,
entropy, log-sum-exp, target); the backward recomputes each chunk's logits instead of keeping them
(verl's fused ``linear_cross_entropy`` and Liger's fused linear losses do the same in Triton). Liger's
kernels compute the gradient inside the forward for a scalar loss of their own; the PPO loss needs the
per-token log-probs first, so this is a plain autograd function and the loss math stays ours.

The numbers are the plain way's: ``logits = (h @ W.T)`` in the hidden states' dtype (what ``torch.autocast``
or a bf16 model computes), then fp32, divided by the temperature, log-softmax over the full vocabulary.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any, cast

import torch
from torch import nn

from rlbus.device_copy import to_device

DEFAULT_CHUNK_TOKENS = 4096

# Model configs whose logits are not a plain linear map of the last hidden state: these keep the full path.
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")


def _tempered(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """z = logits / T in fp32, the quantity both the forward and the backward of a chunk work on."""
    z = logits.float()
    return z / temperature if temperature != 1.0 else z


def chunk_stats(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(log-prob of target, entropy, log-sum-exp) per row of one chunk's logits, in fp32."""
    z = _tempered(logits, temperature)
    lse = torch.logsumexp(z, dim=-1)
    p = torch.exp(z - lse.unsqueeze(-1))
    entropy = lse - (p * z).sum(-1)
    logprob = z.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse
    return logprob, entropy, lse


def chunk_logits_grad(
    logits: torch.Tensor,
    targets: torch.Tensor,
    lse: torch.Tensor,
    entropy: torch.Tensor,
    grad_logprob: torch.Tensor,
    grad_entropy: torch.Tensor,
    temperature: float,
) -> torch.Tensor:
    """d loss / d logits of one chunk, in the logits' dtype: with z = logits / T and p = softmax(z),
    d logprob / d z = onehot(target) - p and d entropy / d z = -p (z - E_p[z]), E_p[z] = lse - entropy."""
    z = _tempered(logits, temperature)
    p = torch.exp(z - lse.unsqueeze(-1))
    mean_z = (lse - entropy).unsqueeze(-1)
    dz = -p * (grad_logprob.unsqueeze(-1) + grad_entropy.unsqueeze(-1) * (z - mean_z))
    hit = torch.arange(z.shape[-1], device=z.device).unsqueeze(0) == targets.unsqueeze(-1)
    dz = torch.where(hit, dz + grad_logprob.unsqueeze(-1), dz)
    if temperature != 1.0:
        dz = dz / temperature
    return dz.to(logits.dtype)


COMPILE_MIN_VOCAB = 8192  # below, a chunk's logits are small: the eager ops cost less than a compile


def compiles_kernels(device: torch.device, vocab: int) -> bool:
    """Whether the chunk kernels are compiled: on CUDA, for a vocabulary large enough that the fused pass
    wins back its compile (the demo model's character vocabulary spent 10 s compiling them on an H100)."""
    return device.type == "cuda" and vocab >= COMPILE_MIN_VOCAB


def _kernel(fn: Callable, device: torch.device, vocab: int) -> Callable:
    """``fn`` compiled by inductor into one fused pass over the chunk's logits where that pays (the eager
    version reads and writes fp32 copies of them several times, which cost more than the matrix products
    at a large vocabulary); eager elsewhere."""
    return _compiled(fn) if compiles_kernels(device, vocab) else fn


@functools.cache
def _compiled(fn: Callable) -> Callable:
    """Once per process and function, with dynamic shapes (chunks and micro-batches vary)."""
    return torch.compile(fn, dynamic=True)


class ChunkedLogprobs(torch.autograd.Function):
    """``(hidden [N, H], weight [V, H], targets [N]) -> (log-probs [N], entropies [N])``, fp32.

    The gradient of a chunk needs only its recomputed logits, its log-sum-exp and its entropy
    (`chunk_logits_grad`). The matrix products run in ``compute_dtype`` (autocast's, else the hidden
    states'), forward and backward alike.
    """

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature: float, chunk: int, compute_dtype):
        n = hidden.shape[0]
        logprobs = torch.empty(n, dtype=torch.float32, device=hidden.device)
        entropy = torch.empty_like(logprobs)
        lse = torch.empty_like(logprobs)
        stats = _kernel(chunk_stats, hidden.device, weight.shape[0])
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(compute_dtype)
            for s in range(0, n, chunk):
                e = min(n, s + chunk)
                logits = hidden[s:e].to(compute_dtype) @ w.T
                logprobs[s:e], entropy[s:e], lse[s:e] = stats(logits, targets[s:e], temperature)
                del logits
        ctx.save_for_backward(hidden, weight, targets, lse, entropy)
        ctx.temperature, ctx.chunk, ctx.compute_dtype = temperature, chunk, compute_dtype
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        hidden, weight, targets, lse, entropy = ctx.saved_tensors
        temperature, chunk, dtype = ctx.temperature, ctx.chunk, ctx.compute_dtype
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_hidden = torch.empty_like(hidden) if need_h else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        g_lp = grad_logprobs.float() if grad_logprobs is not None else torch.zeros_like(lse)
        g_ent = grad_entropy.float() if grad_entropy is not None else torch.zeros_like(lse)
        logits_grad = _kernel(chunk_logits_grad, hidden.device, weight.shape[0])
        n = hidden.shape[0]
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(dtype)
            for s in range(0, n, chunk):
                e = min(n, s + chunk)
                h = hidden[s:e].to(dtype)
                dz = logits_grad(
                    h @ w.T, targets[s:e], lse[s:e], entropy[s:e], g_lp[s:e], g_ent[s:e], temperature
                )
                if need_h:
                    grad_hidden[s:e] = dz @ w
                if need_w:
                    if dz.dtype == torch.float32:
                        grad_weight.addmm_(dz.T, h)
                    else:
                        grad_weight.add_(dz.T @ h)
                del dz, h
        return grad_hidden, grad_weight.to(weight.dtype) if need_w else None, None, None, None, None


def chunked_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    chunk: int = DEFAULT_CHUNK_TOKENS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs and entropies of ``targets`` under ``softmax(hidden @ weight.T / temperature)``; any leading
    shape of ``hidden [..., H]`` / ``targets [...]`` is kept."""
    lead = targets.shape
    device = hidden.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden.dtype
    lp, ent = ChunkedLogprobs.apply(
        hidden.reshape(-1, hidden.shape[-1]),
        weight,
        targets.reshape(-1),
        float(temperature),
        max(1, int(chunk)),
        dtype,
    )
    return lp.view(lead), ent.view(lead)


def supports_chunked_head(model: nn.Module) -> bool:
    """True when the model's logits are ``lm_head(hidden)``: a bias-free linear layer and no logit transform."""
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if type(head) is not nn.Linear or head.bias is not None:  # noqa: E721 (a LoRA-wrapped head is not plain)
        return False
    config = getattr(model, "config", None)
    return not any(getattr(config, name, None) for name in _LOGIT_TRANSFORMS)


@contextlib.contextmanager
def logprob_head(
    model: nn.Module,
    input_ids: torch.Tensor,
    temperature: float,
    chunk: int,
    positions: torch.Tensor | None = None,
) -> Iterator[None]:
    """While active, the model's ``lm_head`` returns ``[B, L-1, 2]`` (log-prob, entropy) of each next token of
    ``input_ids`` in place of logits. The head still runs inside the model's own forward, so FSDP2's hooks
    (which gather the root's parameters, the output projection among them) see an ordinary call.

    ``positions`` (bool ``[B, L-1]``, best on the CPU: its index is taken there, without a device sync): only
    these positions go through the output projection, the others read 0. The loss looks at response tokens
    only, so the prompt's and the padding's share of the largest matrix product of a small model (a
    151,936-row head is over a quarter of Qwen2-0.5B's FLOPs) is skipped, forward and backward."""
    head = cast(Any, model).get_output_embeddings()
    targets = input_ids[:, 1:]

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        states = hidden[:, :-1]
        if positions is None:
            lp, ent = chunked_logprobs(states, head.weight, targets, temperature, chunk)
            return torch.stack((lp, ent), dim=-1)
        index = to_device(positions.reshape(-1).nonzero().squeeze(-1), hidden.device)  # host-side: no sync
        flat = states.reshape(-1, states.shape[-1]).index_select(0, index)
        lp, ent = chunked_logprobs(flat, head.weight, targets.reshape(-1)[index], temperature, chunk)
        out = torch.zeros(targets.numel(), 2, dtype=lp.dtype, device=lp.device)
        out = out.index_copy(0, index, torch.stack((lp, ent), dim=-1))
        return out.view(*targets.shape, 2)

    head.forward = forward
    try:
        yield
    finally:
        del head.forward
