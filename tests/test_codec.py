"""Codec: arrays/tensors as raw bytes + dtype + shape; garbage is rejected with a reason, never unpickled."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
import torch

from rlbus import codec


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.int64, np.uint8, np.bool_])
def test_numpy_round_trip(dtype) -> None:
    arr = (np.arange(12).reshape(3, 4) % 3).astype(dtype)
    out = codec.unpack(codec.pack({"a": arr}))["a"]
    assert out.dtype == arr.dtype and out.shape == arr.shape and np.array_equal(out, arr)
    out[0, 0] = 1  # decoded arrays are writable copies


def test_torch_and_bfloat16_round_trip() -> None:
    t = torch.randn(5, 3)
    b = t.to(torch.bfloat16)
    out = codec.unpack(codec.pack({"t": t, "b": b, "e": torch.zeros(0)}))
    assert np.array_equal(out["t"], t.numpy())
    assert out["b"].dtype == torch.bfloat16 and torch.equal(out["b"], b)
    assert out["e"].shape == (0,)


def test_corrupt_bytes_raise_codec_error() -> None:
    with pytest.raises(codec.CodecError):
        codec.unpack(b"\xc1\xff\x00garbage")


def test_unknown_extension_and_lying_shape_rejected() -> None:
    with pytest.raises(codec.CodecError, match="extension"):
        codec.unpack(msgpack.packb(msgpack.ExtType(42, b"x")))
    header = msgpack.packb(["<f4", [10]])
    lying = msgpack.ExtType(codec.ARRAY_EXT, len(header).to_bytes(4, "little") + header + b"\x00" * 8)
    with pytest.raises(codec.CodecError, match="needs 40 bytes"):
        codec.unpack(msgpack.packb(lying))


def test_object_arrays_refused() -> None:
    header = msgpack.packb(["|O", [1]])
    evil = msgpack.ExtType(codec.ARRAY_EXT, len(header).to_bytes(4, "little") + header + b"\x00" * 8)
    with pytest.raises(codec.CodecError):
        codec.unpack(msgpack.packb(evil))
