"""Header names, limits and the small types the bus hands out: one place for what travels with a message."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import NamedTuple, TypeVar

from nats.js import api as js_api

HEADER_HEADROOM = 8 * 1024
"""Bytes of max_payload kept free for headers: a payload above max_payload - this goes by claim check."""
DUPLICATE_WINDOW_S = 120.0
DLQ_MAX_MSGS = 100_000
DLQ_MAX_AGE_S = 7 * 24 * 3600.0
MAX_REASON_CHARS = 1000
JS_API_TIMEOUT_S = 2.0
"""A JetStream API request's wait (stream and consumer info, consumer creation, direct gets). Short, and retried
(rlbus.bus.retry): on a cluster a request to a stream whose leader just died goes unanswered until NATS elects
a new one (4-9 s), and a 5 s wait (nats-py's default) could add most of another 5 s after the election."""
ACK_TIMEOUT_S = 2.0
"""Wait for an ack's answer; an unanswered ack is then checked against the stream, so this can be short."""
ACK_AFTER_RECONNECT_S = 0.25
"""An ack's first wait right after a reconnect: a restarted server ignores acks of deliveries it lost."""
ACK_IGNORED_TRIES = 2
"""Unanswered acks, with the server up and the delivery still pending, before an ack is given up on."""

CLAIM_HEADER = "Rlbus-Claim"
CLAIM_SIZE_HEADER = "Rlbus-Claim-Size"
KIND_HEADER = "Rlbus-Kind"
REASON_HEADER = "Rlbus-Reason"
STAGE_HEADER = "Rlbus-Stage"
ORIGINAL_SUBJECT_HEADER = "Rlbus-Original-Subject"
ORIGINAL_MSG_ID_HEADER = "Rlbus-Original-Msg-Id"
DELIVERED_HEADER = "Rlbus-Delivered"
STREAM_SEQ_HEADER = "Rlbus-Stream-Seq"
CONSUMER_HEADER = "Rlbus-Consumer"
TRUNCATED_HEADER = "Rlbus-Truncated"
MSG_ID_HEADER = "Nats-Msg-Id"

_NAME_RE = re.compile(r"^[A-Za-z0-9_-]+$")


class BusError(RuntimeError):
    """A bus operation that cannot succeed as asked (conflicting stream or consumer setup)."""


class ClaimMissingError(LookupError):
    """The Object Store no longer holds the bytes a claim-check message points at."""


@dataclass(frozen=True)
class PublishResult:
    """Where a publish landed. `claim` is the Object Store name when the payload went by claim check."""

    stream: str
    seq: int
    duplicate: bool
    size: int
    claim: str | None = None


class DeadLetter(NamedTuple):
    """One entry of the dead-letter stream; unpacks as `(reason, headers, data)`."""

    reason: str
    headers: dict[str, str]
    data: bytes


T = TypeVar("T")


def _one_line(text: str, limit: int = MAX_REASON_CHARS) -> str:
    flat = " ".join(str(text).split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


def _storage(storage: str) -> js_api.StorageType:
    if storage not in ("file", "memory"):
        raise ValueError(f"storage must be 'file' or 'memory', not {storage!r}")
    return js_api.StorageType.FILE if storage == "file" else js_api.StorageType.MEMORY
