"""SDPA for grouped-query attention under a padding mask, without copying the KV cache per query head.

transformers' ``sdpa`` attention repeats K and V up to the query heads (``repeat_kv``) whenever a mask
is given on CUDA, because SDPA's masked kernels do not take ``enable_gqa``. In batched decoding the mask
is always there (left padding), so every step copies the whole static KV cache ``num_key_value_groups``
times: on the H200 that copy and the attention over the inflated cache were 70% of the embedded
engine's decode time for a Qwen2-0.5B shape (7 query heads per KV head).

Here the query heads of one KV head are folded into the query-length axis instead: queries
``[B, Hkv * G, L, D]`` become ``[B, Hkv, G * L, D]`` and the mask ``[B, 1, L, S]`` is repeated G times
along its query axis. Each folded query row still sees exactly its own mask row (causality included),
so the result is the same attention, computed against the KV cache as it is.

A decode step on a GPU (one query position per row) is written out as two matrix products around an fp32
softmax instead of SDPA: SDPA's kernels tile the query axis, which holds only the G folded heads there. On
an H100 (2026-12-06, `bench/decode_attention.py`, kernel time replayed from a CUDA graph, 512 rows x 14
heads over 2 KV heads x 160 positions, compiled): 28.7 us a call, against 48.4 us for SDPA's own pick
(cuDNN), 39.8 us for its memory-efficient kernel and 33.1 us for FlexAttention. ``GQA_SDPA_KERNELS`` keeps
SDPA at every step, for the side-by-side bench.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

GQA_SDPA = "rlbus_gqa_sdpa"
GQA_SDPA_KERNELS = "rlbus_gqa_sdpa_kernels"


def decodes_by_matmul(q_len: int, device: torch.device) -> bool:
    """A decode step (one query position per row) on a GPU: there the two matrix products beat SDPA's
    kernels (module docstring); prefill, scoring and the CPU keep SDPA."""
    return q_len == 1 and device.type == "cuda"


def matmul_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor, scaling: float | None
) -> torch.Tensor:
    """softmax(q k^T * scale + mask) v with the scores in fp32; ``mask`` bool (True attends) or additive."""
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    scores = torch.matmul(query, key.transpose(-1, -2)).float() * scale
    scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask.float()
    return torch.matmul(scores.softmax(-1).to(value.dtype), value)


def folded_gqa_sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor,
    scaling: float | None = None,
    by_matmul: bool = False,
) -> torch.Tensor:
    """Masked attention of ``query [B, H, L, D]`` over ``key/value [B, Hkv, S, D]`` (H a multiple of
    Hkv; query head h reads KV head h // (H / Hkv), as transformers' ``repeat_kv`` lays them out), with
    ``attention_mask`` ``[B or 1, 1, L, S]`` (bool: True attends; or additive float), through SDPA or,
    ``by_matmul``, two matrix products. Returns ``[B, H, L, D]``."""
    batch, heads, q_len, head_dim = query.shape
    kv_heads = key.shape[1]
    groups = heads // kv_heads
    q = query.reshape(batch, kv_heads, groups * q_len, head_dim)
    mask_batch, _, mask_q, kv_len = attention_mask.shape
    mask = attention_mask.expand(mask_batch, 1, q_len, kv_len) if mask_q != q_len else attention_mask
    mask = mask.unsqueeze(2).expand(mask_batch, 1, groups, q_len, kv_len)
    mask = mask.reshape(mask_batch, 1, groups * q_len, kv_len)
    if by_matmul:
        out = matmul_attention(q, key, value, mask, scaling)
    else:
        out = torch.nn.functional.scaled_dot_product_attention(q, key, value, attn_mask=mask, scale=scaling)
    return out.reshape(batch, heads, q_len, head_dim)


def gqa_sdpa_attention_forward(  # noqa: PLR0913 - transformers' attention arguments, plus the kernel choice
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    decode_by_matmul: bool = True,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: the folded path when there is a mask and grouped
    heads, with a decode step on a GPU by matrix products (`decodes_by_matmul`) unless `decode_by_matmul` is
    off, transformers' own ``sdpa`` otherwise (no mask: it passes ``enable_gqa`` itself)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    folds = (
        attention_mask is not None
        and not dropout
        and query.shape[1] != key.shape[1]
        and query.shape[1] % key.shape[1] == 0
        and kwargs.get("position_bias") is None
    )
    if not folds:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    assert attention_mask is not None  # `folds` requires it
    by_matmul = decode_by_matmul and decodes_by_matmul(query.shape[2], query.device)
    out = folded_gqa_sdpa(query, key, value, attention_mask, scaling, by_matmul=by_matmul)
    return out.transpose(1, 2).contiguous(), None  # [B, L, H, D], like sdpa_attention_forward


gqa_sdpa_kernels_attention_forward = functools.partial(gqa_sdpa_attention_forward, decode_by_matmul=False)
"""The same with SDPA's kernels at every step (``GQA_SDPA_KERNELS``: the decode bench's baseline)."""


def register_gqa_sdpa() -> str:
    """Registers both functions (and sdpa's mask format) under ``GQA_SDPA`` and ``GQA_SDPA_KERNELS``;
    returns the name to load with by default."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    for name, forward in (
        (GQA_SDPA, gqa_sdpa_attention_forward),
        (GQA_SDPA_KERNELS, gqa_sdpa_kernels_attention_forward),
    ):
        AttentionInterface.register(name, forward)
        AttentionMaskInterface.register(name, sdpa_mask)
    return GQA_SDPA
