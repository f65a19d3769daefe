"""Wire format of one bucket: tensors flattened at aligned offsets, sealed with a trailer and a digest."""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence

import torch

from rlbus.weight_sync.errors import WeightSyncError, _Corrupt, _SenderAborted
from rlbus.weight_sync.plan import TensorMeta, _aligned, bucket_layout

_HEADER_MAGIC = 0x524C4255_53484452  # "RLBUSHDR"
_FOOTER_MAGIC = 0x524C4255_53465452  # "RLBUSFTR"
_BUCKET_MAGIC = 0x524C4255_53424B54  # "RLBUSBKT"
_ABORT_MAGIC = 0x524C4255_5341424F  # "RLBUSABO"
_STATUS_OK = 0
_STATUS_MISMATCH = 2
_TRAILER_BYTES = 32
_CONTROL_LEN = 8


def _float_bits(value: float) -> int:
    return struct.unpack("<q", struct.pack("<d", float(value)))[0]


def _bits_float(bits: int) -> float:
    return struct.unpack("<d", struct.pack("<q", int(bits)))[0]


def _same_float(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == b


# ----------------------------------------------------------------------------------------------- buckets


def flatten_into(tensors: Sequence[torch.Tensor], out: torch.Tensor) -> int:
    offset = 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        if nbytes:
            src = t.detach().contiguous().reshape(-1).view(torch.uint8)
            out[offset : offset + nbytes].copy_(src, non_blocking=False)
        padded = _aligned(nbytes)
        if padded > nbytes:
            out[offset + nbytes : offset + padded].zero_()
        offset += padded
    return offset


def _payload_bytes(tensors: Sequence[torch.Tensor]) -> int:
    return sum(_aligned(t.numel() * t.element_size()) for t in tensors)


def flatten_bucket(
    tensors: Sequence[torch.Tensor], device: torch.device | str | None = None, extra_bytes: int = 0
) -> torch.Tensor:
    """One uint8 buffer of the tensors' raw bytes at ALIGN-ed offsets: mixed dtypes go in one broadcast.

    `extra_bytes` reserves zeroed room at the end (the sender puts the bucket trailer there, no extra copy).
    """
    if device is None:
        device = tensors[0].device if tensors else torch.device("cpu")
    size = _payload_bytes(tensors)
    out = torch.empty(size + extra_bytes, dtype=torch.uint8, device=device)
    flatten_into(tensors, out)
    if extra_bytes:
        out[size:].zero_()
    return out


def unflatten_bucket(
    flat: torch.Tensor, metas: Sequence[TensorMeta], copy: bool = False
) -> list[torch.Tensor]:
    """Typed, shaped views into `flat` (or fresh copies with copy=True); raises if `flat` is too short."""
    offsets, total = bucket_layout(metas)
    if flat.dtype != torch.uint8 or flat.dim() != 1:
        raise WeightSyncError(f"flat bucket must be 1-D uint8, got {flat.dtype} {tuple(flat.shape)}")
    if flat.numel() < total:
        raise WeightSyncError(f"flat bucket holds {flat.numel()} bytes, metas need {total}")
    out = []
    for meta, offset in zip(metas, offsets, strict=True):
        dtype = meta.torch_dtype
        if meta.numel == 0:
            t = torch.empty(meta.shape, dtype=dtype, device=flat.device)
        else:
            t = flat[offset : offset + meta.nbytes].view(dtype).view(meta.shape)
            if copy:
                t = t.clone()
        out.append(t)
    return out


def _digest(payload: torch.Tensor) -> int:
    """Wrapping int64 sum of the payload's 8-byte words: exact and independent of reduction order."""
    if payload.numel() == 0:
        return 0
    return int(payload.view(torch.int64).sum())


def seal_bucket(wire: torch.Tensor, index: int, abort: bool = False) -> torch.Tensor:
    """Write the trailer into the last 32 bytes of `wire` (payload first); returns `wire`."""
    payload = wire[:-_TRAILER_BYTES]
    magic = _ABORT_MAGIC if abort else _BUCKET_MAGIC
    digest = 0 if abort else _digest(payload)
    trailer = torch.tensor([magic, index, payload.numel(), digest], dtype=torch.int64)
    wire[-_TRAILER_BYTES:].copy_(trailer.view(torch.uint8))
    return wire


def _trailer(wire: torch.Tensor) -> list[int]:
    return [int(x) for x in wire[-_TRAILER_BYTES:].cpu().view(torch.int64).tolist()]


def unseal_bucket(wire: torch.Tensor, index: int) -> torch.Tensor:
    """Check the trailer of a received bucket and return its payload view; raises on abort or corruption."""
    if wire.numel() < _TRAILER_BYTES:
        raise WeightSyncError(f"bucket {index}: {wire.numel()} bytes is shorter than its trailer")
    payload = wire[:-_TRAILER_BYTES]
    magic, got_index, nbytes, digest = _trailer(wire)
    if magic == _ABORT_MAGIC:
        raise _SenderAborted(f"bucket {index}: the sender aborted this push (see the learner's log)")
    if magic != _BUCKET_MAGIC:
        raise _Corrupt(f"bucket {index}: no trailer magic (nothing was received, or a no-op transport)")
    if got_index != index or nbytes != payload.numel():
        raise _Corrupt(
            f"bucket {index}: trailer says bucket {got_index} of {nbytes} bytes, expected {payload.numel()}"
        )
    actual = _digest(payload)
    if actual != digest:
        raise _Corrupt(f"bucket {index}: digest mismatch (sent {digest:#x}, got {actual:#x}): corrupt data")
    return payload
