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
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

GQA_SDPA = "rlbus_gqa_sdpa"


def folded_gqa_sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor,
    scaling: float | None = None,
) -> torch.Tensor:
    """Masked attention of ``query [B, H, L, D]`` over ``key/value [B, Hkv, S, D]`` (H a multiple of
    Hkv; query head h reads KV head h // (H / Hkv), as transformers' ``repeat_kv`` lays them out), with
    ``attention_mask`` ``[B or 1, 1, L, S]`` (bool: True attends; or additive float). Returns
    ``[B, H, L, D]``."""
    batch, heads, q_len, head_dim = query.shape
    kv_heads = key.shape[1]
    groups = heads // kv_heads
    q = query.reshape(batch, kv_heads, groups * q_len, head_dim)
    mask_batch, _, mask_q, kv_len = attention_mask.shape
    mask = attention_mask.expand(mask_batch, 1, q_len, kv_len) if mask_q != q_len else attention_mask
    mask = mask.unsqueeze(2).expand(mask_batch, 1, groups, q_len, kv_len)
    mask = mask.reshape(mask_batch, 1, groups * q_len, kv_len)
    out = torch.nn.functional.scaled_dot_product_attention(q, key, value, attn_mask=mask, scale=scaling)
    return out.reshape(batch, heads, q_len, head_dim)


def gqa_sdpa_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: the folded path when there is a mask and grouped
    heads, transformers' own ``sdpa`` otherwise (no mask: it passes ``enable_gqa`` itself)."""
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
    out = folded_gqa_sdpa(query, key, value, attention_mask, scaling)
    return out.transpose(1, 2).contiguous(), None  # [B, L, H, D], like sdpa_attention_forward


def register_gqa_sdpa() -> str:
    """Registers the function (and sdpa's mask format) under ``GQA_SDPA``; returns the name to load with."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(GQA_SDPA, gqa_sdpa_attention_forward)
    AttentionMaskInterface.register(GQA_SDPA, sdpa_mask)
    return GQA_SDPA
