"""Forward pass to per-token log-probs and entropy, chunked so full-vocabulary fp32 logits never exist."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from rlbus.learner.batch import TrainBatch
from rlbus.device_copy import to_device
from rlbus.learner.varlen_attention import VARLEN_ATTENTION


def forward_logprobs(
    model: nn.Module, mb: TrainBatch, device: torch.device, packed: bool, entropy: bool, chunk: int = 4096
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token log-probs (and entropies) of a micro-batch, ``[B, L-1]`` like the padded batch's masks.

    Padded: the micro-batch is cut to its longest row (right padding makes that exact). Packed, when the
    rows' lengths differ (equal lengths run padded: nothing to remove): all rows' real tokens in ONE row
    with position ids restarting at 0 per sequence and no attention mask, which transformers turns into
    a block-diagonal causal mask (sdpa/eager) or varlen flash attention; the values are scattered back
    into the padded layout (zeros off the real tokens).
    """
    amp = getattr(model, "_rlbus_autocast", None)
    if amp is not None:
        with torch.autocast(device.type, dtype=amp):
            return _forward_logprobs(model, mb, device, packed, entropy, chunk)
    return _forward_logprobs(model, mb, device, packed, entropy, chunk)


def _forward_logprobs(
    model: nn.Module, mb: TrainBatch, device: torch.device, packed: bool, entropy: bool, chunk: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    from rlbus.modeling import token_logprobs

    lengths = mb.attention_mask.sum(-1).long()
    bsz, width = mb.input_ids.shape
    # Rows of one length have no padding to remove: the dense rows are the cheaper layout for the kernels
    # (measured on the H200: varlen over equal lengths ran ~5% below batched flash sdpa).
    # (one row goes the packed way: it is already one row, and varlen attention wants its bounds passed)
    if not packed or (bsz > 1 and bool((lengths == lengths[0]).all())):
        w = max(int(lengths.max()), 2)
        out = token_logprobs(
            model,
            to_device(mb.input_ids[:, :w], device),
            to_device(mb.attention_mask[:, :w], device),
            to_device(mb.position_ids[:, :w], device),
            mb.temperature,
            return_entropy=entropy,
            chunk_tokens=chunk,
            positions=mb.response_mask[:, : w - 1].bool(),
        )
        lp, ent = _with_entropy(out)
        pad = width - w
        if pad:
            lp = torch.nn.functional.pad(lp, (0, pad))
            ent = torch.nn.functional.pad(ent, (0, pad)) if ent is not None else None
        return lp, ent
    keep = torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)  # [B, L] real tokens (right padded)
    ids = mb.input_ids[keep].unsqueeze(0)
    pos = mb.position_ids[keep].unsqueeze(0)
    bounds = {}
    if getattr(getattr(model, "config", None), "_attn_implementation", None) == VARLEN_ATTENTION:
        # the sequence bounds, from host-side lengths: no device sync inside the (compiled) layers
        cu = to_device(torch.nn.functional.pad(torch.cumsum(lengths, 0), (1, 0)).to(torch.int32), device)
        max_len = int(lengths.max())
        bounds = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max_len, max_length_k=max_len)
    # packed index j predicts packed token j + 1; row b's predictions t = 0..n_b-2 sit at offset_b + t
    offsets = torch.cumsum(lengths, 0) - lengths
    n_pred = (lengths - 1).clamp(min=0)
    rows = torch.repeat_interleave(torch.arange(bsz), n_pred)
    cols = torch.cat([torch.arange(int(n)) for n in n_pred]) if bsz else torch.zeros(0, dtype=torch.long)
    src = torch.repeat_interleave(offsets, n_pred) + cols
    wanted = torch.zeros(1, max(int(ids.shape[1]) - 1, 0), dtype=torch.bool)
    wanted[0, src] = mb.response_mask[rows, cols].bool()
    out = token_logprobs(
        model,
        to_device(ids, device),
        None,
        to_device(pos, device),
        mb.temperature,
        return_entropy=entropy,
        chunk_tokens=chunk,
        positions=wanted,
        **bounds,
    )
    lp_p, ent_p = _with_entropy(out)
    src, rows, cols = to_device(src, device), to_device(rows, device), to_device(cols, device)

    def scatter(values: torch.Tensor) -> torch.Tensor:
        base = torch.zeros(bsz, width - 1, dtype=values.dtype, device=values.device)
        return base.index_put((rows, cols), values[0, src])

    return scatter(lp_p), scatter(ent_p) if ent_p is not None else None


def _with_entropy(
    out: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`token_logprobs`' answer as (log-probs, entropy or None)."""
    return out if isinstance(out, tuple) else (out, None)
