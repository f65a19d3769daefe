"""JetStream work queues between the stages: typed publish, validated pull consumers, dead letters.

Guarantees the rest of rlbus builds on:
- A work item stays in its stream until a consumer acks it; an un-acked item is redelivered after
  `ack_wait_s` to any replica sharing the durable name.
- A consumer only ever hands out messages that decoded and validated. Anything else (bad bytes,
  wrong kind or schema version, missing claim-check object, or an item that failed `max_deliver`
  times) is copied to the run's dead-letter stream with the reason, then terminated.
- Payloads bigger than the server's `max_payload` travel by claim check: the bytes go to the run's
  Object Store and the work queue carries a small message with an `Rlbus-Claim` header.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Awaitable, Generator
from dataclasses import dataclass
from types import TracebackType
from typing import Any, NamedTuple, TypeVar

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import JetStreamContext
from nats.js import api as js_api
from nats.js.errors import (
    BadRequestError,
    BucketNotFoundError,
    NotFoundError,
    ObjectNotFoundError,
)
from nats.js.object_store import ObjectStore

from rlbus import codec
from rlbus.bus.connect import connect as _connect
from rlbus.bus.connect import log
from rlbus.bus.retry import PUBLISH_DEADLINE_S, RETRYABLE, with_retry
from rlbus.bus.state import RunState
from rlbus.bus.subjects import STAGE_MESSAGE, RunNames, Stage
from rlbus.codec import CodecError
from rlbus.config.schema import BusConfig, RlbusConfig
from rlbus.messages import Message, MessageError, decode, encode

HEADER_HEADROOM = 8 * 1024
"""Bytes of max_payload kept free for headers: a payload above max_payload - this goes by claim check."""
DUPLICATE_WINDOW_S = 120.0
DLQ_MAX_MSGS = 100_000
DLQ_MAX_AGE_S = 7 * 24 * 3600.0
MAX_REASON_CHARS = 1000
ACK_TIMEOUT_S = 2.0
"""Wait for an ack's answer; an unanswered ack is then checked against the stream, so this can be short."""
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


class Delivery:
    """One validated work item. Settle it exactly once: ack, nak, term or dead_letter."""

    def __init__(self, consumer: Consumer, msg: Msg, message: Message, claim: str | None) -> None:
        self._consumer = consumer
        self.raw = msg
        self.message = message
        self.claim = claim
        self.settled = False

    @property
    def num_delivered(self) -> int:
        return int(self.raw.metadata.num_delivered)

    @property
    def stream_seq(self) -> int:
        return int(self.raw.metadata.sequence.stream)

    @property
    def headers(self) -> dict[str, str]:
        return dict(self.raw.headers or {})

    def _settle(self) -> bool:
        if self.settled:
            return False
        self.settled = True
        return True

    async def ack(self, timeout: float = ACK_TIMEOUT_S) -> bool:
        """Ack and wait for the server's confirmation, then drop the claim-check object.

        Through a NATS restart an ack may go unanswered: its reply was lost, or the restarted server
        lost the delivery (a crash rolls consumer state back) and ignores acks for it. Every work
        stream is a work queue, so an acked item has left its stream: that is checked after each
        unanswered try. An ack that cannot be confirmed is logged and given up on (returns False)
        instead of raising: the item comes back by redelivery, and every stage deduplicates (msg ids,
        the learner's ledger). Its claim-check object is then kept for the redelivery.
        """
        if not self._settle():
            return True
        confirmed = await self._ack_through_reconnects(timeout)
        if confirmed and self.claim:
            await self._consumer.bus._delete_claim(self.claim)
        return confirmed

    async def _ack_through_reconnects(self, timeout: float) -> bool:
        deadline = time.monotonic() + PUBLISH_DEADLINE_S
        delay, ignored = 0.1, 0
        while True:
            try:
                await self.raw.ack_sync(timeout=timeout)
                return True
            except RETRYABLE as exc:
                error = f"{type(exc).__name__}: {exc}"
            fate = await self._consumer.bus._ack_fate(self.raw)
            if fate == "gone":
                return True  # the ack got through; only its answer was lost
            if fate == "pending":
                ignored += 1  # the server answers, still holds the delivery, and did not answer our ack
            if fate == "forgotten" or ignored >= ACK_IGNORED_TRIES or time.monotonic() + delay >= deadline:
                log.warning(
                    "bus.ack_unconfirmed",
                    stage=self._consumer.stage.value,
                    seq=self.stream_seq,
                    error=error,
                    fate=fate or "server away",
                    note="the item will be redelivered and deduplicated downstream",
                )
                return False
            log.warning("bus.retry", what="ack", error=error, retry_in_s=round(delay, 2))
            await asyncio.sleep(delay)
            delay = min(delay * 2, 2.0)

    async def nak(self, delay: float | None = None) -> None:
        """Ask for redelivery (after `delay` s). On the last allowed delivery it dead-letters instead."""
        if self.num_delivered >= self._consumer.max_deliver:
            await self.dead_letter(f"failed on all {self._consumer.max_deliver} deliveries (last one nak'd)")
            return
        if not self._settle():
            return
        await self.raw.nak(delay=delay)

    async def in_progress(self) -> None:
        """Still working: restart the ack_wait clock (call it during long steps)."""
        if not self.settled:
            await self.raw.in_progress()

    async def term(self) -> None:
        """Drop the item for good (no dead letter) and its claim-check object."""
        if not self._settle():
            return
        await self.raw.term()
        if self.claim:
            await self._consumer.bus._delete_claim(self.claim)

    async def dead_letter(self, reason: str) -> None:
        """A valid message the service cannot use: park it on the DLQ with `reason` and terminate it."""
        if not self._settle():
            return
        await self._consumer._dead_letter(self.raw, reason)


class Consumer:
    """A pull consumer on one stage's work queue; replicas sharing `durable` share the work."""

    def __init__(
        self,
        bus: Bus,
        stage: Stage,
        durable: str,
        expected: type[Message] | None,
        sub: JetStreamContext.PullSubscription,
        ack_wait_s: float,
        max_deliver: int,
    ) -> None:
        self.bus = bus
        self.stage = stage
        self.durable = durable
        self.expected = expected
        self.ack_wait_s = ack_wait_s
        self.max_deliver = max_deliver
        self.dead_letters = 0  # messages this consumer parked on the DLQ (for metrics)
        self._sub = sub

    async def fetch(self, batch: int = 1, timeout: float = 5.0) -> list[Delivery]:
        """Up to `batch` valid deliveries, waiting at most `timeout` s for the first; [] on timeout.

        Invalid messages met on the way are dead-lettered and do not count; the wait goes on.
        """
        deadline = time.monotonic() + timeout
        out: list[Delivery] = []
        while not out:
            remaining = deadline - time.monotonic()
            if remaining <= 0.01:
                break
            try:
                msgs = await self._sub.fetch(batch=batch, timeout=max(remaining, 0.05))
            except (TimeoutError, NatsTimeoutError):
                break
            except RETRYABLE as exc:  # the server is away: an empty batch, the caller loops anyway
                log.warning("bus.fetch_failed", stage=self.stage.value, error=f"{type(exc).__name__}: {exc}")
                await asyncio.sleep(min(0.5, max(deadline - time.monotonic(), 0)))
                break
            for msg in msgs:
                delivery = await self._accept(msg)
                if delivery is not None:
                    out.append(delivery)
        return out

    async def _accept(self, msg: Msg) -> Delivery | None:
        headers = msg.headers or {}
        claim = headers.get(CLAIM_HEADER)
        delivered = int(msg.metadata.num_delivered)
        if delivered > self.max_deliver:
            # The server allows one delivery more than max_deliver so that this one can park it.
            await self._dead_letter(
                msg, f"not acked after {self.max_deliver} deliveries (ack_wait {self.ack_wait_s}s)"
            )
            return None
        try:
            data = await self.bus._get_claim(claim) if claim else msg.data
            message = decode(data, self.expected)
        except (CodecError, MessageError, ClaimMissingError) as exc:
            await self._dead_letter(msg, str(exc))
            return None
        except (TimeoutError, NatsTimeoutError, ConnectionError) as exc:
            log.warning("bus.claim_fetch_failed", stage=self.stage.value, claim=claim, error=str(exc))
            await msg.nak(delay=1.0)  # transient: try again later
            return None
        except Exception as exc:  # anything else a hostile or broken payload can raise while decoding
            await self._dead_letter(msg, f"undecodable: {type(exc).__name__}: {exc}")
            return None
        return Delivery(self, msg, message, claim)

    async def _dead_letter(self, msg: Msg, reason: str) -> None:
        ok = await self.bus._publish_dead_letter(self.stage, msg, reason, self.durable)
        if ok:
            await msg.term()
            self.dead_letters += 1
        else:
            await msg.nak(delay=1.0)  # the DLQ is unreachable: keep the item rather than lose it

    async def pending(self) -> int:
        """Items waiting for this consumer plus items handed out but not yet acked."""
        info = await self._sub.consumer_info()
        return int(info.num_pending or 0) + int(info.num_ack_pending or 0)

    async def close(self) -> None:
        """Stop pulling; the durable consumer (and its un-acked items) stays on the server."""
        try:
            await self._sub.unsubscribe()
        except Exception as exc:  # closing twice or on a closed connection is harmless
            log.debug("bus.consumer_close", durable=self.durable, error=str(exc))


class _Opening:
    """`Bus.connect(...)`: await it for a Bus, or use it as `async with` to close on exit."""

    def __init__(self, coro: Awaitable[Bus]) -> None:
        self._coro = coro
        self._bus: Bus | None = None

    def __await__(self) -> Generator[Any, None, Bus]:
        return self._coro.__await__()

    async def __aenter__(self) -> Bus:
        self._bus = await self._coro
        return self._bus

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._bus is not None:
            await self._bus.close()


class Bus:
    """The run's view of NATS: work-queue streams per stage, the DLQ, the blob store and the state KV."""

    def __init__(self, nc: Client, run_id: str, cfg: BusConfig | None = None) -> None:
        self.nc = nc
        self.js = nc.jetstream()
        self.names = RunNames(run_id)
        self.cfg = cfg or BusConfig()
        self._obs: ObjectStore | None = None
        self._state: RunState | None = None

    @property
    def run_id(self) -> str:
        return self.names.run_id

    @classmethod
    async def open(
        cls,
        cfg: RlbusConfig,
        url: str | None = None,
        name: str = "rlbus",
        ensure: bool = True,
        storage: str | None = None,
    ) -> Bus:
        """Connect (url defaults to `cfg.bus.url`) and, unless `ensure=False`, create the run's streams."""
        target = url or cfg.bus.url
        if not target:
            raise BusError("no NATS url: pass one or set bus.url (see rlbus.bus.resolve_bus_url)")
        nc = await _connect(cfg.bus, target, name)
        bus = cls(nc, cfg.run.id, cfg.bus)
        if ensure:
            try:
                await bus.ensure_streams(storage or cfg.bus.storage)
            except BaseException:
                await nc.close()
                raise
        return bus

    @classmethod
    def connect(
        cls,
        cfg: RlbusConfig,
        url: str | None = None,
        name: str = "rlbus",
        ensure: bool = True,
        storage: str | None = None,
    ) -> _Opening:
        """`async with Bus.connect(cfg, url, name) as bus:` (or `bus = await Bus.connect(...)`)."""
        return _Opening(cls.open(cfg, url, name, ensure, storage))

    async def close(self) -> None:
        if not self.nc.is_closed:
            await self.nc.close()

    async def __aenter__(self) -> Bus:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    # ---------------------------------------------------------------- streams

    async def _add_or_update(self, config: js_api.StreamConfig) -> None:
        try:
            await self.js.add_stream(config)
        except BadRequestError as exc:
            if exc.err_code != 10058:  # "stream name already in use with a different configuration"
                raise
            try:
                await self.js.update_stream(config)
            except BadRequestError as exc2:
                raise BusError(
                    f"stream {config.name} exists with a setup that cannot change to what this run asks "
                    f"({exc2.description}); delete the run (`rlbus up --fresh`) or use the same bus.storage"
                ) from exc2

    async def ensure_streams(self, storage: str = "file") -> None:
        """Create or update the work-queue streams, the DLQ and the blob store. Idempotent."""
        st = _storage(storage)
        for stage in Stage:
            await self._add_or_update(
                js_api.StreamConfig(
                    name=self.names.stream(stage),
                    subjects=[self.names.subject(stage)],
                    retention=js_api.RetentionPolicy.WORK_QUEUE,
                    storage=st,
                    max_msg_size=-1,
                    duplicate_window=DUPLICATE_WINDOW_S,
                    discard=js_api.DiscardPolicy.OLD,
                )
            )
        await self._add_or_update(
            js_api.StreamConfig(
                name=self.names.dlq_stream,
                subjects=[self.names.dlq_wildcard],
                retention=js_api.RetentionPolicy.LIMITS,
                storage=st,
                max_msg_size=-1,
                max_msgs=DLQ_MAX_MSGS,
                max_age=DLQ_MAX_AGE_S,
                duplicate_window=DUPLICATE_WINDOW_S,
                discard=js_api.DiscardPolicy.OLD,
            )
        )
        self._obs = await self._object_store(create=True, storage=st)

    async def _object_store(
        self, create: bool = False, storage: js_api.StorageType | None = None
    ) -> ObjectStore:
        if self._obs is not None:
            return self._obs
        bucket = self.names.blobs_bucket
        try:
            self._obs = await self.js.object_store(bucket)
        except (BucketNotFoundError, NotFoundError):
            if not create:
                raise
            self._obs = await self.js.create_object_store(
                bucket, config=js_api.ObjectStoreConfig(storage=storage or js_api.StorageType.FILE)
            )
        return self._obs

    async def stream_depth(self, stage: Stage | str) -> int:
        """Messages in the stage's stream: queued or handed out but not yet acked."""
        info = await self.js.stream_info(self.names.stream(stage))
        return int(info.state.messages)

    async def dead_letter_count(self, stage: Stage | str | None = None) -> int:
        """Dead letters kept for the run (or for one stage)."""
        if stage is None:
            info = await self.js.stream_info(self.names.dlq_stream)
            return int(info.state.messages)
        subject = self.names.dlq_subject(stage)
        info = await self.js.stream_info(self.names.dlq_stream, subjects_filter=subject)
        return int((info.state.subjects or {}).get(subject, 0))

    async def purge_run(self) -> None:
        """Empty every stream of the run (work, DLQ, blobs, state) but keep them."""
        for stream in self.names.all_streams():
            try:
                await self.js.purge_stream(stream)
            except NotFoundError:
                pass

    async def delete_run(self) -> None:
        """Delete every stream, the KV bucket and the object store of the run."""
        for stream in self.names.all_streams():
            try:
                await self.js.delete_stream(stream)
            except NotFoundError:
                pass
        self._obs = None
        self._state = None

    async def state(self) -> RunState:
        """The run's RunState (KV bucket), created on first use."""
        if self._state is None:
            self._state = await RunState.open(self.js, self.names, storage=self.cfg.storage)
        return self._state

    # ---------------------------------------------------------------- publish

    @property
    def inline_limit(self) -> int:
        """Largest payload sent inline; anything bigger goes by claim check."""
        return max(1024, int(self.nc.max_payload) - HEADER_HEADROOM)

    async def publish(
        self,
        stage: Stage | str,
        message: Message,
        msg_id: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> PublishResult:
        """Encode and publish on the stage's work queue; `msg_id` deduplicates within 2 min.

        Without a `msg_id` one is generated, so the retries through a reconnect never duplicate.
        """
        stage = Stage(stage)
        data = encode(message)
        hdrs = {KIND_HEADER: message.kind, **(headers or {})}
        hdrs[MSG_ID_HEADER] = msg_id if msg_id is not None else f"auto-{self.nc._nuid.next().decode()}"
        subject, stream = self.names.subject(stage), self.names.stream(stage)
        if len(data) <= self.inline_limit:
            ack = await self._js_publish(subject, data, stream, hdrs, what=f"publish {stage.value}")
            return PublishResult(ack.stream, ack.seq, bool(ack.duplicate), len(data))
        return await self._publish_claim(stage, subject, stream, data, hdrs, message.kind)

    async def _js_publish(
        self, subject: str, data: bytes, stream: str | None, hdrs: dict[str, str], what: str
    ) -> js_api.PubAck:
        timeout = 2.0 + len(data) / (2 * 1024 * 1024)  # short: a retry (deduplicated) beats a long wait
        return await with_retry(
            what, lambda: self.js.publish(subject, data, timeout=timeout, stream=stream, headers=dict(hdrs))
        )

    async def _publish_claim(
        self, stage: Stage, subject: str, stream: str, data: bytes, hdrs: dict[str, str], kind: str
    ) -> PublishResult:
        obs = await self._object_store()
        # Always a fresh name: a duplicate publish must never overwrite the blob of a live claim.
        name = f"{stage.value}/{self.nc._nuid.next().decode()}"
        chunk = max(128 * 1024, min(1024 * 1024, self.inline_limit // 2))
        meta = js_api.ObjectMeta(name=name, options=js_api.ObjectMetaOptions(max_chunk_size=chunk))
        await with_retry(f"claim put {stage.value}", lambda: obs.put(name, data, meta=meta))
        hdrs = {**hdrs, CLAIM_HEADER: name, CLAIM_SIZE_HEADER: str(len(data))}
        stub = codec.pack({"claim": name, "size": len(data), "kind": kind, "bucket": self.names.blobs_bucket})
        try:
            ack = await self._js_publish(subject, stub, stream, hdrs, what=f"publish claim {stage.value}")
        except BaseException:
            await self._delete_claim(name)
            raise
        if ack.duplicate:
            await self._delete_claim(name)
        log.debug(
            "bus.claim_check", stage=stage.value, claim=name, size=len(data), duplicate=bool(ack.duplicate)
        )
        return PublishResult(ack.stream, ack.seq, bool(ack.duplicate), len(data), claim=name)

    async def publish_raw(
        self, subject: Stage | str, data: bytes, headers: dict[str, str] | None = None
    ) -> js_api.PubAck:
        """Publish bytes as they are (tests, tools); a Stage means that stage's work subject."""
        if isinstance(subject, Stage) or subject in {s.value for s in Stage}:
            subject = self.names.subject(subject)
        return await self.js.publish(subject, data, headers=headers)

    async def _ack_fate(self, msg: Msg) -> str | None:
        """After an unanswered ack: 'gone' (it left its work-queue stream: acked), 'forgotten' (the
        consumer's delivered pointer is below it: a restarted server lost this delivery and will make
        a new one), 'pending', or None when the server cannot be asked."""
        meta = msg.metadata
        seq = int(meta.sequence.stream)
        try:
            try:
                await self.js.get_msg(meta.stream, seq=seq)
            except NotFoundError:
                return "gone"
            info = await self.js.consumer_info(meta.stream, meta.consumer)
        except Exception as exc:  # the server is away again
            log.debug("bus.ack_check_failed", stream=meta.stream, error=f"{type(exc).__name__}: {exc}")
            return None
        delivered = int(info.delivered.stream_seq or 0) if info.delivered is not None else 0
        return "forgotten" if delivered < seq else "pending"

    async def _get_claim(self, name: str) -> bytes:
        try:
            obs = await self._object_store()
            result = await obs.get(name)
        except (ObjectNotFoundError, BucketNotFoundError) as exc:
            raise ClaimMissingError(
                f"claim-check object {name!r} is missing from {self.names.blobs_bucket}"
            ) from exc
        return bytes(result.data or b"")

    async def _delete_claim(self, name: str) -> None:
        try:
            obs = await self._object_store()
            await obs.delete(name)
        except ObjectNotFoundError:
            pass
        except Exception as exc:  # an orphan blob is only wasted space; never fail an ack for it
            log.warning("bus.claim_delete_failed", claim=name, error=str(exc))

    # ---------------------------------------------------------------- consume

    async def consumer(
        self,
        stage: Stage | str,
        durable: str,
        expected: type[Message] | None = None,
        ack_wait_s: float | None = None,
        max_deliver: int | None = None,
        max_ack_pending: int = 1000,
    ) -> Consumer:
        """Pull consumer on a stage. `expected` defaults to the stage's message type.

        A work-queue stream allows one durable per stage: all replicas of a service share `durable`.
        """
        stage = Stage(stage)
        if not _NAME_RE.match(durable):
            raise ValueError(f"durable name {durable!r} must match {_NAME_RE.pattern}")
        ack_wait = float(ack_wait_s if ack_wait_s is not None else self.cfg.ack_wait_s)
        deliver = int(max_deliver if max_deliver is not None else self.cfg.max_deliver)
        stream, subject = self.names.stream(stage), self.names.subject(stage)
        config = js_api.ConsumerConfig(
            name=durable,
            durable_name=durable,
            ack_policy=js_api.AckPolicy.EXPLICIT,
            deliver_policy=js_api.DeliverPolicy.ALL,
            ack_wait=ack_wait,
            max_deliver=deliver + 1,  # the extra delivery is the one that dead-letters it
            filter_subject=subject,
            max_ack_pending=max_ack_pending,
            max_waiting=512,
        )
        try:
            await self.js.add_consumer(stream, config=config)
        except BadRequestError as exc:
            if exc.err_code in (10099, 10100):
                raise BusError(
                    f"stage {stage.value} already has another consumer on its work queue; every replica "
                    f"of a service must use the same durable name ({exc.description})"
                ) from exc
            # Exists with settings that cannot be changed in place: bind to it as it is.
            log.warning("bus.consumer_kept", stage=stage.value, durable=durable, reason=exc.description)
        sub = await self.js.pull_subscribe_bind(durable=durable, stream=stream)
        expected_cls = expected if expected is not None else STAGE_MESSAGE[stage]
        return Consumer(self, stage, durable, expected_cls, sub, ack_wait, deliver)

    async def delete_consumer(self, stage: Stage | str, durable: str) -> bool:
        """Remove a stage's durable consumer (un-acked items return to the queue for the next one)."""
        try:
            return bool(await self.js.delete_consumer(self.names.stream(stage), durable))
        except NotFoundError:
            return False

    # ---------------------------------------------------------------- dead letters

    async def _publish_dead_letter(self, stage: Stage, msg: Msg, reason: str, consumer: str) -> bool:
        meta = msg.metadata
        seq = int(meta.sequence.stream)
        hdrs = {k: v for k, v in (msg.headers or {}).items() if not k.startswith("Nats-")}
        original_id = (msg.headers or {}).get(MSG_ID_HEADER)
        if original_id:
            hdrs[ORIGINAL_MSG_ID_HEADER] = original_id
        hdrs.update(
            {
                REASON_HEADER: _one_line(reason),
                STAGE_HEADER: stage.value,
                ORIGINAL_SUBJECT_HEADER: msg.subject,
                DELIVERED_HEADER: str(meta.num_delivered),
                STREAM_SEQ_HEADER: str(seq),
                CONSUMER_HEADER: consumer,
                # Idempotent: if we die between this publish and the term, the redelivery dedups here.
                MSG_ID_HEADER: f"dlq-{meta.stream}-{seq}",
            }
        )
        data = msg.data or b""
        room = self.inline_limit
        if len(data) > room:
            hdrs[TRUNCATED_HEADER] = str(len(data))
            data = data[:room]
        try:
            await self._js_publish(
                self.names.dlq_subject(stage), data, self.names.dlq_stream, hdrs, what="dead letter"
            )
        except Exception as exc:
            log.error(
                "bus.dead_letter_failed",
                stage=stage.value,
                seq=seq,
                reason=hdrs[REASON_HEADER],
                error=str(exc),
            )
            return False
        log.warning(
            "bus.dead_letter",
            stage=stage.value,
            seq=seq,
            delivered=meta.num_delivered,
            reason=hdrs[REASON_HEADER],
        )
        return True

    async def dead_letters(self, stage: Stage | str | None = None, limit: int = 100) -> list[DeadLetter]:
        """The oldest `limit` dead letters of the run (or of one stage), read without consuming them."""
        subject = self.names.dlq_subject(stage) if stage is not None else self.names.dlq_wildcard
        out: list[DeadLetter] = []
        seq = 1
        while len(out) < limit:
            try:
                raw = await self.js.get_msg(self.names.dlq_stream, seq=seq, subject=subject, next=True)
            except NotFoundError:
                break
            headers = dict(raw.headers or {})
            out.append(DeadLetter(headers.get(REASON_HEADER, ""), headers, bytes(raw.data or b"")))
            seq = int(raw.seq or seq) + 1
        return out
