"""The learner side of a push: the send plan and the sender that streams buckets to every replica."""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from rlbus.weight_sync.errors import WeightSyncError
from rlbus.weight_sync.group import Backend, WeightGroup, _control, _Pending
from rlbus.weight_sync.plan import (
    TensorMeta,
    _sum_and_abs,
    _validate_buckets,
    bucket_layout,
    checksums_match,
    dtype_to_str,
    plan_buckets,
    plan_fingerprint,
)
from rlbus.weight_sync.wire import (
    _FOOTER_MAGIC,
    _HEADER_MAGIC,
    _STATUS_MISMATCH,
    _STATUS_OK,
    _TRAILER_BYTES,
    _float_bits,
    flatten_into,
    seal_bucket,
)


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
        self._hosted: tuple[int, dist.TCPStore] | None = None  # (port, store) hosted for the next group
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

    def listen(self, port: int, world_size: int) -> None:
        """Listen at host:port for the next group's ranks (closing the current group), before it is announced:
        ranks that come early find the store listening instead of backing off (WeightGroup.host_store)."""
        self.close()
        rdv_s = self.timeout_s if self.rendezvous_timeout_s is None else self.rendezvous_timeout_s
        self._hosted = (port, WeightGroup.host_store(self.host, port, world_size, rdv_s))

    def open(self, port: int, world_size: int, epoch: int) -> None:
        """Form the epoch's group at host:port and block until all world_size ranks joined.

        Call listen() with the same port before announcing the epoch (receivers block in the same rendezvous);
        without it the store starts listening here. An old group is closed first; on timeout this raises
        WeightSyncError and the sender stays closed and reusable for another open().
        """
        hosted = self._hosted[1] if self._hosted is not None and self._hosted[0] == port else None
        self.close()  # the old group; `hosted` is the new one's
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
            hosted=hosted,
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
                bucket_sum, failure = self._fill(wire, iterator, metas, k, k == n - 1, len(plan.metas))
                sent_sum += bucket_sum
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
            self._send_footer(group, plan, sent_sum)
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

    def _fill(
        self, wire: torch.Tensor, iterator: Iterator, metas: list[TensorMeta], k: int, last: bool, total: int
    ) -> tuple[float, BaseException | None]:
        """Bucket k's tensors packed and sealed into `wire`: (their sum when verifying, None), or, when the
        caller's iterator fails, an ABORT-sealed bucket and the failure (the receivers must still get it)."""
        try:
            tensors = self._take(iterator, metas)
            if last and next(iterator, None) is not None:
                raise WeightSyncError(f"more tensors than the plan's {total}")
            bucket_sum = sum(_sum_and_abs(t, with_abs=False)[0] for t in tensors) if self.verify else 0.0
            flatten_into(tensors, wire)
            del tensors
            seal_bucket(wire, k)
            return bucket_sum, None
        except Exception as exc:  # noqa: BLE001 - anything from the caller's iterator
            wire.zero_()
            seal_bucket(wire, k, abort=True)
            return 0.0, exc

    def _send_footer(self, group: WeightGroup, plan: SendPlan, sent_sum: float) -> None:
        """The footer: what was sent sums to what the plan announced, or every receiver drops the push."""
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

    @staticmethod
    def _take(
        iterator: Iterator[tuple[str, torch.Tensor]], metas: Sequence[TensorMeta]
    ) -> list[torch.Tensor]:
        return [next_matching(iterator, meta) for meta in metas]

    def close(self) -> None:
        """Close the group (receivers' pending broadcasts fail at once) and free the packing buffers."""
        group, self._group = self._group, None
        self._hosted = None
        self._buffers = [None, None]
        if group is not None:
            group.close()
