"""The errors of a weight push: one public type, and the internal ones that steer draining."""

from __future__ import annotations


class WeightSyncError(RuntimeError):
    """Any failure of a weight push: rendezvous timeout, dead peer, corrupt or mismatched data."""


class RendezvousTimeout(WeightSyncError):
    """Not every rank reached the group's rendezvous in time; `missing` names the ranks that did not (empty
    when the master itself was unreachable)."""

    def __init__(self, message: str, missing: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.missing = missing


class _SenderAborted(WeightSyncError):
    """The sender marked the bucket ABORT and stopped the push there: nothing left to drain."""


class _Corrupt(WeightSyncError):
    """Bucket failed verification; the sender keeps sending, so the receiver must drain the rest."""


class _HeaderMismatch(WeightSyncError):
    """The sender's plan is not the one this receiver was told about: sizes differ, so it cannot drain."""
