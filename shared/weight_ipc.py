"""Weight handoff through CUDA IPC between a learner and replicas that share its GPU.

NCCL refuses two ranks on one GPU, and staging through host memory costs seconds per push. Here the learner
keeps one persistent flat buffer on its GPU, shares its IPC handle once (in the weight announcement), and
per version fills it with a device copy. A replica maps the buffer once per buffer id, copies it into its
own memory (one device copy), verifies the fp64 checksum, and acks on NATS; the learner never refills the
buffer before every member acked or timed out, and a late reader that sees a refill fails its checksum
instead of loading mixed weights.

Handles travel as plain fields (bytes and ints, no pickle); the GPU is found by UUID, not index, so a
replica with another CUDA_VISIBLE_DEVICES maps the same memory. Both processes must share the host's IPC
namespace (same host; in containers `ipc: host`).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from rlbus.weight_sync import (
    TensorMeta,
    WeightSyncError,
    bucket_layout,
    checksums_match,
    dtype_to_str,
    unflatten_bucket,
)
from rlbus.weight_sync.sender import next_matching
from rlbus.weight_sync.wire import flatten_into

_CHUNK = 1 << 24  # elements per fp64 partial sum: bounds the temporary
_REFILL_BYTES = 256 << 20  # bytes of tensors per multi-tensor copy when refilling the shared buffer


def device_checksum(tensors: Iterable[torch.Tensor], with_abs: bool = False) -> tuple[float, float]:
    """fp64 sum (and sum of |x|) of all values, accumulated on the tensors' device with one sync at the end.

    Same quantity as rlbus.weight_sync.weights_checksum (fp64 accumulation; reduction order may differ by
    rounding noise, which checksums_match allows), without a host round trip per chunk.
    """
    total: torch.Tensor | None = None
    absolute: torch.Tensor | None = None
    for tensor in tensors:
        flat = tensor.detach().reshape(-1)
        for start in range(0, flat.numel(), _CHUNK):
            chunk = flat[start : start + _CHUNK]
            s = chunk.sum(dtype=torch.float64)
            total = s if total is None else total + s
            if with_abs:
                a = torch.linalg.vector_norm(chunk, 1, dtype=torch.float64)
                absolute = a if absolute is None else absolute + a
    return (0.0 if total is None else float(total)), (0.0 if absolute is None else float(absolute))


def dtype_runs(flat: torch.Tensor, metas: Sequence[TensorMeta]) -> list[torch.Tensor]:
    """The flat buffer as one typed view per run of consecutive same-dtype tensors.

    Alignment padding between tensors is zero (rlbus.weight_sync.flatten_into writes it so), so each view's
    sum equals the sum of its tensors: a whole model checksums in a few reductions instead of two per
    tensor, which matters in a replica whose generation thread holds the GIL most of the time."""
    offsets, total = bucket_layout(metas)
    runs: list[torch.Tensor] = []
    start = 0
    for i, meta in enumerate(metas):
        end = offsets[i + 1] if i + 1 < len(metas) else total
        if i + 1 < len(metas) and metas[i + 1].dtype == meta.dtype:
            continue
        dtype = meta.torch_dtype
        nbytes = (end - start) // dtype.itemsize * dtype.itemsize
        if nbytes:
            runs.append(flat[start : start + nbytes].view(dtype))
        start = end
    return runs


def _gpu_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


def local_index_of(device_uuid: str) -> int:
    """This process's CUDA index of the GPU with that UUID; WeightSyncError when it is not visible here."""
    for index in range(torch.cuda.device_count()):
        if _gpu_uuid(index) == device_uuid:
            return index
    raise WeightSyncError(
        f"GPU {device_uuid} (the learner's) is not visible to this replica: CUDA IPC needs the same GPU; "
        "set trainer.weight_sync_backend=auto or nccl"
    )


def _allocate_shareable(nbytes: int, device: torch.device) -> torch.Tensor:
    """A buffer from a plain cudaMalloc segment: expandable segments (a good default for the rest of the
    process) cannot be exported as legacy IPC handles, so they are switched off for this one allocation."""
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") + "," + os.environ.get("PYTORCH_ALLOC_CONF", "")
    expandable = "expandable_segments:True" in conf.replace(" ", "")
    setter = getattr(torch.cuda.memory, "_set_allocator_settings", None)
    if expandable and setter is not None:
        setter("expandable_segments:False")
    try:
        return torch.empty(nbytes, dtype=torch.uint8, device=device)
    finally:
        if expandable and setter is not None:
            setter("expandable_segments:True")


class IpcWeightSender:
    """The learner's side: one shared flat buffer on its GPU, refilled per version."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        if self.device.type != "cuda":
            raise WeightSyncError(f"CUDA IPC needs the learner on a GPU, got {self.device}")
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self._buffer: torch.Tensor | None = None
        self._handle: dict[str, Any] | None = None
        self._metas: list[TensorMeta] | None = None  # the buffer's layout, fixed by the first fill
        self._views: list[torch.Tensor] | None = None  # [buffer, one typed view per tensor]
        self.last_fill_seconds = 0.0

    @property
    def handle(self) -> dict[str, Any] | None:
        """The announcement's `ipc_buffer` fields, or None before the first fill."""
        return self._handle

    def _ensure(self, nbytes: int) -> torch.Tensor:
        if self._buffer is not None and self._buffer.numel() >= nbytes:
            return self._buffer
        self._buffer = None
        self._buffer = _allocate_shareable(nbytes, self.device)
        storage = self._buffer.untyped_storage()
        (_, handle, size, offset, ref_handle, ref_offset, event_handle, event_sync) = storage._share_cuda_()
        self._handle = {
            "buffer_id": uuid.uuid4().hex,
            "device_uuid": _gpu_uuid(self.device.index),
            "handle": bytes(handle),
            "storage_size": int(size),
            "storage_offset": int(offset),
            "ref_counter_handle": bytes(ref_handle),
            "ref_counter_offset": int(ref_offset),
            "event_handle": bytes(event_handle) if event_handle else b"",
            "event_sync_required": bool(event_sync),
            "nbytes": int(nbytes),
        }
        return self._buffer

    def fill(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> tuple[list[TensorMeta], float]:
        """Copy the tensors into the shared buffer (aligned layout of rlbus.weight_sync.bucket_layout) and
        return their metas and fp64 checksum. Call only when no replica is reading (every ack is in).

        The first fill takes the tensors in one list (their sizes decide the buffer's); later fills stream
        them one at a time into the layout already made, so no second copy of the model is ever held."""
        import time

        t0 = time.perf_counter()
        with torch.cuda.device(self.device):
            if self._metas is None:
                items = [(name, t.detach()) for name, t in named_tensors]
                metas = [TensorMeta(name, dtype_to_str(t.dtype), list(t.shape)) for name, t in items]
                buffer = self._ensure(max(bucket_layout(metas)[1], 1))
                flatten_into([t.to(self.device, non_blocking=True) for _, t in items], buffer)
                del items
                self._metas = metas
            else:
                metas, maybe = self._metas, self._buffer
                assert maybe is not None
                buffer = maybe
                self._refill(named_tensors, metas, buffer)
            checksum, _ = device_checksum(dtype_runs(buffer, metas))
            torch.cuda.current_stream(self.device).synchronize()  # bytes are in place before anyone is told
        self.last_fill_seconds = time.perf_counter() - t0
        return metas, checksum

    def _refill(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], metas: list[TensorMeta], buffer: torch.Tensor
    ) -> None:
        """Copies a new version into the layout: multi-tensor copies of up to _REFILL_BYTES at a time (a
        few kernel launches instead of one per tensor, which matters while generation shares the GPU),
        never holding more than that of gathered tensors. The zero padding from the first fill stays."""
        if self._views is None or self._views[0].data_ptr() != buffer.data_ptr():
            offsets, _ = bucket_layout(metas)
            self._views = [
                buffer[off : off + m.nbytes].view(m.torch_dtype).view(m.shape)
                for m, off in zip(metas, offsets, strict=True)
            ]
            self._views = [buffer, *self._views]  # [0] remembers which buffer the views are of
        views = self._views[1:]
        iterator = iter(named_tensors)
        dst: list[torch.Tensor] = []
        src: list[torch.Tensor] = []
        pending = 0
        for meta, view in zip(metas, views, strict=True):
            tensor = next_matching(iterator, meta).detach()
            dst.append(view)
            src.append(tensor.to(self.device, non_blocking=True))
            pending += view.numel() * view.element_size()
            if pending >= _REFILL_BYTES:
                torch._foreach_copy_(dst, src)
                dst, src, pending = [], [], 0
        if dst:
            torch._foreach_copy_(dst, src)
        if next(iterator, None) is not None:
            raise WeightSyncError(f"more tensors than the shared buffer's {len(metas)}")

    def close(self) -> None:
        self._buffer = None
        self._handle = None
        self._metas = None
        self._views = None


class IpcWeightReceiver:
    """A replica's side: maps the learner's buffer (once per buffer id) and copies a verified version out."""

    def __init__(self) -> None:
        self._mapped: torch.Tensor | None = None
        self._buffer_id: str | None = None
        self._stream: torch.cuda.Stream | None = None
        self.last_receive_seconds = 0.0

    def _map(self, handle: dict[str, Any]) -> torch.Tensor:
        if self._mapped is not None and self._buffer_id == handle["buffer_id"]:
            return self._mapped
        self.close()  # a learner restart shares a new buffer: let go of the old mapping
        index = local_index_of(handle["device_uuid"])
        torch.cuda._lazy_init()
        try:
            storage = torch.UntypedStorage._new_shared_cuda(
                index,
                handle["handle"],
                handle["storage_size"],
                handle["storage_offset"],
                handle["ref_counter_handle"],
                handle["ref_counter_offset"],
                handle["event_handle"] or None,
                handle["event_sync_required"],
            )
        except Exception as exc:  # noqa: BLE001 - torch raises RuntimeError with the CUDA reason
            raise WeightSyncError(f"cannot map the learner's CUDA IPC buffer on GPU {index}: {exc}") from exc
        flat = torch.empty(0, dtype=torch.uint8, device=torch.device("cuda", index))
        flat.set_(storage, 0, (handle["nbytes"],), (1,))
        self._mapped, self._buffer_id = flat, handle["buffer_id"]
        self._stream = torch.cuda.Stream(device=index)
        return flat

    def receive(
        self, handle: dict[str, Any], metas: Sequence[TensorMeta], checksum: float
    ) -> dict[str, torch.Tensor]:
        """Our own copy of the announced version (verified against `checksum`), as name -> tensor views."""
        import time

        t0 = time.perf_counter()
        shared = self._map(handle)
        _, total = bucket_layout(metas)
        if total > shared.numel():
            raise WeightSyncError(
                f"the shared buffer holds {shared.numel()} bytes, the announcement needs {total}"
            )
        assert self._stream is not None
        with torch.cuda.stream(self._stream):
            own = shared[:total].clone()  # one device copy; the learner may refill after our ack
            tensors = unflatten_bucket(own, metas)
            got, got_abs = device_checksum(dtype_runs(own, metas), with_abs=True)
        self._stream.synchronize()
        if not checksums_match(checksum, got, got_abs):
            raise WeightSyncError(
                f"checksum mismatch over CUDA IPC: announced {checksum!r}, read {got!r} (refilled while reading?)"
            )
        self.last_receive_seconds = time.perf_counter() - t0
        return {m.name: t for m, t in zip(metas, tensors, strict=True)}

    def close(self) -> None:
        self._mapped = None
        self._buffer_id = None
        self._stream = None
