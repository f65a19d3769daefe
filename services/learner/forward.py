"""Forward pass to per-token log-probs and entropy, chunked so full-vocabulary fp32 logits never exist."""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from rlbus.learner.batch import TrainBatch
from rlbus.chunked_logprobs import DEFAULT_CHUNK_TOKENS
from rlbus.device_copy import to_device
from rlbus.learner.varlen_attention import VARLEN_ATTENTION
from rlbus.modeling import round_up

SEQ_MULTIPLE = 8
"""A compiled learner's sequence axis is a multiple of this: torch.compile's kernels guard on its alignment
(eager layers take `seq_multiple=1`: padding would only cost compute)."""


def forward_logprobs(
    model: nn.Module,
    mb: TrainBatch,
    device: torch.device,
    packed: bool,
    entropy: bool,
    chunk: int = DEFAULT_CHUNK_TOKENS,
    seq_multiple: int = 1,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token log-probs (and entropies) of a micro-batch, ``[B, L-1]`` like the padded batch's masks.

    Padded: the micro-batch is cut to its longest row, rounded up to `seq_multiple` (right padding makes that
    exact). Packed, unless the rows have one length that is a multiple of `seq_multiple` (those run padded:
    nothing to remove): all rows' real tokens in ONE row
    with position ids restarting at 0 per sequence and no attention mask, which transformers turns into
    a block-diagonal causal mask (sdpa/eager) or varlen flash attention; the values are scattered back
    into the padded layout (zeros off the real tokens).
    """
    amp = getattr(model, "_rlbus_autocast", None)
    if amp is not None:
        with torch.autocast(device.type, dtype=amp):
            return _forward_logprobs(model, mb, device, packed, entropy, chunk, seq_multiple)
    return _forward_logprobs(model, mb, device, packed, entropy, chunk, seq_multiple)


def _forward_logprobs(  # noqa: PLR0913
    model: nn.Module,
    mb: TrainBatch,
    device: torch.device,
    packed: bool,
    entropy: bool,
    chunk: int,
    seq_multiple: int,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    from rlbus.modeling import token_logprobs

    # the host-side bookkeeping in numpy: torch's CPU ops wait on its thread pool, milliseconds each on a
    # busy GPU host (see _packed_layout)
    lengths = mb.attention_mask.cpu().numpy().sum(-1).astype(np.int64)
    bsz, width = mb.input_ids.shape
    # Rows of one length, a multiple of seq_multiple, have no padding to remove: the dense rows are the
    # cheaper layout for the kernels (measured on the H200: varlen over equal lengths ran ~5% below batched
    # flash sdpa). Other equal lengths would need padding, and a mask: a third graph; they pack.
    # (one row goes the packed way: it is already one row, and varlen attention wants its bounds passed)
    equal = bsz > 1 and bool((lengths == lengths[0]).all())
    if not packed or (equal and lengths[0] % seq_multiple == 0):
        # cut to the longest row, rounded up to seq_multiple (past the batch's width if need be: more right
        # padding), so the compiled layers see one alignment of the sequence axis, not one graph per alignment
        w = round_up(max(int(lengths.max()), 2), seq_multiple)
        grow = w - width

        def cut(t: torch.Tensor, n: int) -> torch.Tensor:  # a view, copied only where the width must grow
            return F.pad(t, (0, grow)) if grow > 0 else t[:, :n]

        out = token_logprobs(
            model,
            to_device(cut(mb.input_ids, w), device),
            to_device(cut(mb.attention_mask, w), device),
            to_device(cut(mb.position_ids, w), device),
            mb.temperature,
            return_entropy=entropy,
            chunk_tokens=chunk,
            positions=cut(mb.response_mask, w - 1).bool(),
        )
        lp, ent = _with_entropy(out)
        lp, ent = lp[:, : width - 1], ent[:, : width - 1] if ent is not None else None
        pad = width - min(w, width)
        if pad:
            lp = F.pad(lp, (0, pad))
            ent = F.pad(ent, (0, pad)) if ent is not None else None
        return lp, ent
    layout = _packed_layout(mb, lengths, seq_multiple)
    bounds = {}
    if getattr(getattr(model, "config", None), "_attn_implementation", None) == VARLEN_ATTENTION:
        # the sequence bounds, from host-side lengths: no device sync inside the (compiled) layers
        segments = np.append(lengths, layout.filler) if layout.filler else lengths
        cu = to_device(torch.from_numpy(np.concatenate([[0], np.cumsum(segments)]).astype(np.int32)), device)
        max_len = int(segments.max())
        bounds = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max_len, max_length_k=max_len)
    out = token_logprobs(
        model,
        to_device(layout.ids, device),
        None,
        to_device(layout.pos, device),
        mb.temperature,
        return_entropy=entropy,
        chunk_tokens=chunk,
        positions=layout.wanted,
        **bounds,
    )
    lp_p, ent_p = _with_entropy(out)
    src, rows, cols = (to_device(t, device) for t in (layout.src, layout.rows, layout.cols))

    def scatter(values: torch.Tensor) -> torch.Tensor:
        base = torch.zeros(bsz, width - 1, dtype=values.dtype, device=values.device)
        return base.index_put((rows, cols), values[0, src])

    return scatter(lp_p), scatter(ent_p) if ent_p is not None else None


class PackedLayout(NamedTuple):
    """Where a micro-batch's real tokens sit in its one packed row (`_packed_layout`)."""

    ids: torch.Tensor
    pos: torch.Tensor
    wanted: torch.Tensor
    rows: torch.Tensor
    cols: torch.Tensor
    src: torch.Tensor
    filler: int


def _packed_layout(mb: TrainBatch, n: np.ndarray, seq_multiple: int) -> PackedLayout:
    """Where the real tokens of right-padded rows go in one packed row, worked out with numpy on the host
    (torch's CPU gathers, in a busy GPU host's thread pool, took milliseconds each: measured in the packed
    learner step's profile on the H200). Packed index j predicts packed token j + 1, so row b's predictions
    t = 0..n_b-2 sit at offset_b + t; the last token of a row predicts the next row's first (not wanted).

    The packed row ends in a filler sequence (pad tokens, positions from 0, nothing wanted) that rounds its
    length up to `seq_multiple`: the compiled layers then see one alignment of the sequence axis, not a graph
    per alignment (inductor guards on it: two recompiles in a GPU run's first step).

    ids/pos ``[1, T]``; wanted ``[1, T-1]`` (response positions); rows/cols/src: padded (row, column) of
    each prediction and its packed index; filler: the filler's length. ``n``: the rows' lengths."""
    keep = np.arange(mb.input_ids.shape[1])[None, :] < n[:, None]
    n_pred = np.maximum(n - 1, 0)
    rows = np.repeat(np.arange(len(n)), n_pred)
    cols = np.arange(int(n_pred.sum())) - np.repeat(np.cumsum(n_pred) - n_pred, n_pred)
    src = np.repeat(np.cumsum(n) - n, n_pred) + cols
    total = int(n.sum())
    filler = round_up(total, seq_multiple) - total
    wanted = np.zeros(max(total + filler - 1, 0), dtype=bool)
    wanted[src] = mb.response_mask.numpy()[rows, cols] > 0
    ids, pos = mb.input_ids.numpy()[keep], mb.position_ids.numpy()[keep]
    if filler:
        ids = np.concatenate([ids, np.full(filler, ids[-1], dtype=ids.dtype)])
        pos = np.concatenate([pos, np.arange(filler, dtype=pos.dtype)])
    return PackedLayout(
        ids=torch.from_numpy(ids)[None],
        pos=torch.from_numpy(pos)[None],
        wanted=torch.from_numpy(wanted)[None],
        rows=torch.from_numpy(rows),
        cols=torch.from_numpy(cols),
        src=torch.from_numpy(src),
        filler=filler,
    )


def _with_entropy(
    out: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`token_logprobs`' answer as (log-probs, entropy or None)."""
    return out if isinstance(out, tuple) else (out, None)
