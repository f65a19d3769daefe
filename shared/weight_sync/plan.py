"""What a push carries: tensor metadata, the bucket plan and its fingerprint, and the weights checksum."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from rlbus.weight_sync.errors import WeightSyncError

ALIGN = 16
"""Byte alignment of every tensor inside a flat bucket, so that dtype views of the buffer are legal."""
_CHECKSUM_CHUNK = 1 << 22  # elements per fp64 chunk: bounds the temporary copy to 32 MiB


def dtype_to_str(dtype: torch.dtype) -> str:
    """`torch.bfloat16` -> "bfloat16" (the spelling slime/SGLang use on the wire)."""
    return str(dtype).removeprefix("torch.")


def dtype_from_str(name: str) -> torch.dtype:
    """Parse "bfloat16" or "torch.bfloat16"; a name that is not a torch dtype raises WeightSyncError."""
    value = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(value, torch.dtype):
        raise WeightSyncError(f"unknown dtype {name!r}")
    return value


@dataclass(frozen=True)
class TensorMeta:
    """What a receiver must know to allocate and interpret one tensor of a push."""

    name: str
    dtype: str
    shape: list[int] = field(default_factory=list)

    @property
    def torch_dtype(self) -> torch.dtype:
        return dtype_from_str(self.dtype)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.torch_dtype.itemsize


def describe_tensors(named: Iterable[tuple[str, torch.Tensor]]) -> list[TensorMeta]:
    """Metadata of (name, tensor) pairs in order: what an announcement carries instead of the tensors."""
    return [TensorMeta(name, dtype_to_str(t.dtype), list(t.shape)) for name, t in named]


def metas_from_lists(
    names: Sequence[str], dtypes: Sequence[str], shapes: Sequence[Sequence[int]]
) -> list[TensorMeta]:
    """Rebuild metas from the parallel lists of an announcement; unequal lengths mean a broken message."""
    if not len(names) == len(dtypes) == len(shapes):
        raise WeightSyncError(f"names/dtypes/shapes lengths differ: {len(names)}/{len(dtypes)}/{len(shapes)}")
    metas = [
        TensorMeta(n, d, [int(s) for s in shape]) for n, d, shape in zip(names, dtypes, shapes, strict=True)
    ]
    for meta in metas:
        meta.torch_dtype  # noqa: B018 - validates the dtype string early
    return metas


def metas_from_announcement(announcement: Any) -> list[TensorMeta]:
    """Duck-typed over anything with `names`, `dtypes`, `shapes` (e.g. rlbus.messages.WeightAnnouncement)."""
    return metas_from_lists(announcement.names, announcement.dtypes, announcement.shapes)


def _aligned(nbytes: int) -> int:
    return (nbytes + ALIGN - 1) // ALIGN * ALIGN


def bucket_layout(metas: Sequence[TensorMeta]) -> tuple[list[int], int]:
    """Byte offset of each tensor inside the flat bucket, and the payload size (a multiple of ALIGN)."""
    offsets, total = [], 0
    for meta in metas:
        offsets.append(total)
        total += _aligned(meta.nbytes)
    return offsets, total


def plan_buckets(metas: Sequence[TensorMeta], bucket_bytes: int) -> list[list[int]]:
    """Group consecutive tensors so each bucket's payload is <= bucket_bytes (a lone bigger tensor gets its own)."""
    if bucket_bytes <= 0:
        raise ValueError("bucket_bytes must be positive")
    buckets: list[list[int]] = []
    current: list[int] = []
    size = 0
    for i, meta in enumerate(metas):
        nbytes = _aligned(meta.nbytes)
        if current and nbytes and size + nbytes > bucket_bytes:
            buckets.append(current)
            current, size = [], 0
        current.append(i)
        size += nbytes
    if current:
        buckets.append(current)
    return buckets


def _validate_buckets(metas: Sequence[TensorMeta], buckets: Sequence[Sequence[int]]) -> None:
    flat = [i for bucket in buckets for i in bucket]
    if flat != list(range(len(metas))):
        raise WeightSyncError(
            f"buckets must list tensor indices 0..{len(metas) - 1} once each, in order (got {len(flat)} entries)"
        )
    if any(not bucket for bucket in buckets):
        raise WeightSyncError("empty bucket in plan")


def plan_fingerprint(metas: Sequence[TensorMeta], buckets: Sequence[Sequence[int]]) -> int:
    """63-bit hash of names, dtypes, shapes and bucket split: both sides must agree before any byte moves."""
    h = hashlib.blake2b(digest_size=8)
    for meta in metas:
        h.update(f"{meta.name}\0{meta.dtype}\0{','.join(map(str, meta.shape))}\n".encode())
    for bucket in buckets:
        h.update(f"b{len(bucket)}\n".encode())
    return int.from_bytes(h.digest(), "little") & ((1 << 63) - 1)


# ----------------------------------------------------------------------------------------------- checksums


def _sum_and_abs(tensor: torch.Tensor, with_abs: bool = True) -> tuple[float, float]:
    """fp64 sum and sum of |x| of one tensor, in bounded chunks (a whole-tensor fp64 copy could be huge)."""
    flat = tensor.detach().reshape(-1)
    if flat.is_complex():
        flat = torch.view_as_real(flat).reshape(-1)
    total = 0.0
    absolute = 0.0
    # Half-precision floats reduce faster in place with an fp64 accumulator; the rest converts first (the
    # fp64 reductions of integer and bool tensors need real values).
    in_place = flat.dtype in (torch.bfloat16, torch.float16)
    for start in range(0, flat.numel(), _CHECKSUM_CHUNK):
        chunk = flat[start : start + _CHECKSUM_CHUNK]
        if in_place:
            total += float(chunk.sum(dtype=torch.float64))
            if with_abs:
                absolute += float(torch.linalg.vector_norm(chunk, 1, dtype=torch.float64))
            continue
        chunk = chunk.to(torch.float64)
        total += float(chunk.sum())
        if with_abs:
            absolute += float(chunk.abs().sum())
    return total, absolute


def weights_checksum(tensors: Iterable[torch.Tensor]) -> float:
    """fp64 sum of all values: cheap, order-insensitive, catches stale, zeroed or misread weights."""
    return sum(_sum_and_abs(t, with_abs=False)[0] for t in tensors)


def checksums_match(expected: float, got: float, abs_sum: float = 0.0) -> bool:
    """Equal up to fp64 summation-order noise (thread counts and devices reorder the reduction)."""
    if math.isnan(expected) or math.isnan(got):
        return math.isnan(expected) and math.isnan(got)
    if math.isinf(expected) or math.isinf(got):
        return expected == got
    return abs(expected - got) <= 1e-9 * max(abs_sum, abs(expected), abs(got)) + 1e-12
