"""Packed (varlen) attention: sequences concatenated in one row attend only within themselves."""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    pass


VARLEN_ATTENTION = "rlbus_varlen"
_cu_cache: dict[str, Any] = {}
_VARLEN_PARAMS: frozenset[str] = frozenset()  # varlen_attn's keyword names in this torch, read once


def packed_attention(device: torch.device, compute_dtype: torch.dtype) -> str:
    """``attn_implementation`` for packed rows: varlen flash attention (``torch.nn.attention.varlen``) on
    CUDA in bf16/fp16, so a packed row costs the sum of its sequences' attention, not the whole row's.
    Elsewhere ``sdpa``, which transformers gives a block-diagonal causal mask from the position ids."""
    if device.type != "cuda" or compute_dtype not in (torch.bfloat16, torch.float16):
        return "sdpa"
    try:
        from torch.nn.attention.varlen import varlen_attn
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError:
        return "sdpa"
    global _VARLEN_PARAMS
    _VARLEN_PARAMS = frozenset(inspect.signature(varlen_attn).parameters)
    AttentionInterface.register(VARLEN_ATTENTION, _varlen_attention_forward)
    AttentionMaskInterface.register(VARLEN_ATTENTION, _varlen_mask)
    return VARLEN_ATTENTION


def _varlen_mask(*args: Any, **kwargs: Any) -> Any:
    """No mask for one (packed) row: the attention reads the sequence bounds from the position ids."""
    from transformers.masking_utils import sdpa_mask

    if kwargs.get("batch_size", args[0] if args else None) == 1:
        return None
    return sdpa_mask(*args, **kwargs)


@torch.compiler.disable  # host-side ints: one opaque op; the learner passes the bounds in instead
def _cu_seqlens(position_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Sequence starts (position 0) -> int32 cumulative lengths and the longest length, once per forward
    (for callers that do not pass ``cu_seq_lens_q``/``max_length_q``)."""
    # every layer gets the same position_ids object; holding it keeps its id from being reused
    if _cu_cache.get("pos") is not position_ids:
        pos = position_ids.reshape(-1)
        starts = torch.nonzero(pos == 0).flatten()
        if starts.numel() == 0 or int(starts[0]) != 0:
            starts = torch.cat([starts.new_zeros(1), starts])
        cu = torch.cat([starts, starts.new_tensor([pos.numel()])]).to(torch.int32)
        _cu_cache.update(pos=position_ids, value=(cu, int((cu[1:] - cu[:-1]).max())))
    return _cu_cache["value"]


def _varlen_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    from torch.nn.attention.varlen import varlen_attn
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    position_ids = kwargs.get("position_ids")
    if query.shape[0] != 1:  # a padded batch (scoring outside the packed path): plain sdpa with its mask
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    if position_ids is None or kwargs.get("sliding_window") or dropout:
        raise RuntimeError("varlen attention needs position ids, no sliding window and no dropout")
    if kwargs.get("cu_seq_lens_q") is not None and kwargs.get("max_length_q") is not None:
        cu, max_len = kwargs["cu_seq_lens_q"], int(kwargs["max_length_q"])
    else:
        cu, max_len = _cu_seqlens(position_ids)
    dev = query.device.type
    # autocast does not cover this op, and rotary embeddings leave q/k in fp32: use the compute dtype
    dt = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else value.dtype
    q = query[0].transpose(0, 1).to(dt).contiguous()  # [T, H, D]
    k = key[0].transpose(0, 1).to(dt)
    v = value[0].transpose(0, 1).to(dt)
    rep = q.shape[1] // k.shape[1]
    params = _VARLEN_PARAMS
    extra: dict[str, Any] = {}
    if rep > 1 and "enable_gqa" in params:
        extra["enable_gqa"] = True
    elif rep > 1:
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    if "window_size" in params:
        extra["window_size"] = (-1, 0)  # causal
    else:
        extra["is_causal"] = True
    head_dim = q.shape[-1]
    if "scale" in params:
        extra["scale"] = scaling
    elif scaling is not None and abs(scaling - head_dim**-0.5) > 1e-12:
        q = q * (scaling * head_dim**0.5)
    out = varlen_attn(q, k.contiguous(), v.contiguous(), cu, cu, max_len, max_len, **extra)
    if isinstance(out, tuple):
        out = out[0]
    return out.unsqueeze(0), None  # [1, T, H, D], like sdpa_attention_forward
