"""The replica side of a push: receive, verify and load buckets, draining what it rejects."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from rlbus.weight_sync.errors import WeightSyncError, _Corrupt, _HeaderMismatch, _SenderAborted
from rlbus.weight_sync.group import Backend, WeightGroup, _control, _Pending
from rlbus.weight_sync.plan import (
    TensorMeta,
    _sum_and_abs,
    _validate_buckets,
    bucket_layout,
    checksums_match,
    plan_fingerprint,
)
from rlbus.weight_sync.wire import (
    _ABORT_MAGIC,
    _FOOTER_MAGIC,
    _HEADER_MAGIC,
    _STATUS_MISMATCH,
    _TRAILER_BYTES,
    _bits_float,
    _same_float,
    _trailer,
    unflatten_bucket,
    unseal_bucket,
)


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
        bucket_lists = [list(b) for b in buckets]
        _validate_buckets(metas, bucket_lists)
        start = time.monotonic()
        received = 0
        got_sum = 0.0
        got_abs = 0.0
        n = len(bucket_lists)
        pending: tuple[_Pending, torch.Tensor] | None = None
        next_k = 0  # first bucket not yet posted
        header_done = False
        finished = False
        try:
            header = _control(group, None)
            header_done = True
            self._check_header(header, group, metas, bucket_lists)
            plan_checksum = _bits_float(header[3])
            if checksum is not None and not _same_float(float(checksum), plan_checksum):
                raise _Corrupt(
                    f"the sender pushes checksum {plan_checksum!r}, the announcement given says {checksum!r} "
                    "(stale or out-of-order announcement)"
                )
            if n:
                pending = self._post(group, metas, bucket_lists[0])
                next_k = 1
            for k, bucket in enumerate(bucket_lists):
                assert pending is not None
                work, wire = pending
                pending = None
                work.wait()
                if _trailer(wire)[0] == _ABORT_MAGIC:  # the sender stops here: post nothing more
                    raise _SenderAborted(f"bucket {k}: the sender aborted this push (see the learner's log)")
                if next_k < n:  # keep the wire busy while we verify and hand out this bucket
                    pending = self._post(group, metas, bucket_lists[next_k])
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
            _check_footer(footer, plan_checksum, got_sum, got_abs)
        except _SenderAborted:
            finished = True  # the sender stopped after that bucket: nothing to drain
            raise
        except _HeaderMismatch:
            # Sizes disagree, so we cannot even drain: leave the group; the sender's next broadcast fails fast.
            self._break()
            raise
        finally:
            if not finished and header_done and group.is_open:
                self._drain(group, metas, bucket_lists, pending, next_k)
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


def _check_footer(footer: list[int], plan_checksum: float, got_sum: float, got_abs: float) -> None:
    """The push is whole only when the footer is in step and every checksum agrees with what arrived."""
    if footer[0] != _FOOTER_MAGIC:
        raise WeightSyncError("push footer has no magic: the group is out of step")
    sent_sum = _bits_float(footer[1])
    if footer[2] == _STATUS_MISMATCH:
        raise WeightSyncError("the sender reports its tensors changed between plan and send: discard")
    if not checksums_match(sent_sum, got_sum, got_abs):
        raise WeightSyncError(f"checksum mismatch: sender {sent_sum!r}, received {got_sum!r}: discard")
    if not checksums_match(plan_checksum, got_sum, got_abs):
        raise WeightSyncError(f"checksum mismatch: announced {plan_checksum!r}, received {got_sum!r}")
