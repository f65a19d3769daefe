"""msgpack codec for bus messages: numpy arrays and torch tensors travel as raw bytes + dtype + shape.

No pickle anywhere: a peer can only ever make us build plain data and arrays.
"""

from __future__ import annotations

import math
from typing import Any

import msgpack
import numpy as np

ARRAY_EXT = 1
MAX_FRAME_BYTES = 512 * 1024 * 1024
_BF16 = "bfloat16"


class CodecError(ValueError):
    """Bytes that are not a well-formed rlbus frame."""


def _array_header_and_bytes(obj: Any) -> tuple[str, list[int], memoryview] | None:
    if isinstance(obj, np.ndarray):
        arr = np.ascontiguousarray(obj)
        return arr.dtype.str, list(arr.shape), arr.data.cast("B") if arr.size else memoryview(b"")
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a hard dependency, but the codec does not need it
        return None
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        if t.dtype == torch.bfloat16:
            raw = t.view(torch.uint16).numpy()
            return _BF16, list(t.shape), raw.data.cast("B") if raw.size else memoryview(b"")
        arr = t.numpy()
        return arr.dtype.str, list(arr.shape), arr.data.cast("B") if arr.size else memoryview(b"")
    return None


def _default(obj: Any) -> Any:
    found = _array_header_and_bytes(obj)
    if found is not None:
        dtype, shape, data = found
        header = msgpack.packb([dtype, shape], use_bin_type=True)
        return msgpack.ExtType(ARRAY_EXT, len(header).to_bytes(4, "little") + header + bytes(data))
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, tuple):
        return list(obj)
    raise TypeError(f"cannot encode {type(obj).__name__} on the bus")


def _ext_hook(code: int, data: bytes) -> Any:
    if code != ARRAY_EXT:
        raise CodecError(f"unknown msgpack extension type {code}")
    if len(data) < 4:
        raise CodecError("truncated array header")
    header_len = int.from_bytes(data[:4], "little")
    dtype, shape = msgpack.unpackb(data[4 : 4 + header_len], raw=False)
    payload = memoryview(data)[4 + header_len :]
    if dtype == _BF16:
        import torch

        raw = np.frombuffer(payload, dtype=np.uint16).copy()
        return torch.from_numpy(raw.view(np.int16)).view(torch.bfloat16).reshape(shape)
    np_dtype = np.dtype(dtype)
    if np_dtype.hasobject:
        raise CodecError("object arrays are not allowed on the bus")
    expected = math.prod(shape) * np_dtype.itemsize  # exact ints; np.prod cost ~5 us per array
    if expected != len(payload):
        raise CodecError(f"array of {dtype}{shape} needs {expected} bytes, got {len(payload)}")
    return np.frombuffer(payload, dtype=np_dtype).reshape(shape).copy()


def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, default=_default, use_bin_type=True)


def unpack(data: bytes) -> Any:
    try:
        return msgpack.unpackb(
            data,
            raw=False,
            ext_hook=_ext_hook,
            strict_map_key=True,
            max_bin_len=MAX_FRAME_BYTES,
            max_str_len=MAX_FRAME_BYTES,
            max_array_len=MAX_FRAME_BYTES,
            max_map_len=MAX_FRAME_BYTES,
            max_ext_len=MAX_FRAME_BYTES,
        )
    except CodecError:
        raise
    except Exception as exc:  # msgpack raises several unrelated types for bad bytes
        raise CodecError(f"not a msgpack frame: {type(exc).__name__}: {exc}") from exc
