"""JetStream work queues between the stages: typed publish, validated pull consumers, dead letters.

Guarantees the rest of rlbus builds on:
- A work item stays in its stream until a consumer acks it; an un-acked item is redelivered after `ack_wait_s`
  to any replica sharing the durable name.
- A consumer only ever hands out messages that decoded and validated. Anything else (bad bytes, wrong kind or
  schema version, missing claim-check object, or an item that failed `max_deliver` times) is copied to the
  run's dead-letter stream with the reason, then terminated.
- Payloads bigger than the server's `max_payload` travel by claim check: the bytes go to the run's Object
  Store and the work queue carries a small message with an `Rlbus-Claim` header.
"""

from __future__ import annotations

from types import TracebackType
from typing import Any, overload

from nats.aio.client import Client
from nats.aio.msg import Msg
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
from rlbus.bus.consumer import Consumer, M
from rlbus.bus.disconnects import unless_disconnected
from rlbus.bus.duplicates import DIGEST_HEADER, DuplicateVerdict, judge_duplicate, payload_digest
from rlbus.bus.fan_in import FanInConsumer
from rlbus.bus.headers import (
    _NAME_RE,
    CLAIM_HEADER,
    CLAIM_SIZE_HEADER,
    CONSUMER_HEADER,
    DELIVERED_HEADER,
    HEADER_HEADROOM,
    JS_API_TIMEOUT_S,
    KIND_HEADER,
    MSG_ID_HEADER,
    ORIGINAL_MSG_ID_HEADER,
    ORIGINAL_SUBJECT_HEADER,
    REASON_HEADER,
    STAGE_HEADER,
    STREAM_SEQ_HEADER,
    TRUNCATED_HEADER,
    BusError,
    ClaimMissingError,
    DeadLetter,
    PublishResult,
    _one_line,
    _storage,
)
from rlbus.bus.object_read import read_object
from rlbus.bus.opening import Opening
from rlbus.bus.retry import with_retry
from rlbus.bus.state import RunState
from rlbus.bus.streams import ensure_work_streams
from rlbus.bus.subjects import STAGE_MESSAGE, RunNames, Stage, partition_key
from rlbus.config.schema import BusConfig, RlbusConfig
from rlbus.messages import Message, encode


class Bus:
    """The run's view of NATS: work-queue streams per stage, the DLQ, the blob store and the state KV."""

    def __init__(self, nc: Client, run_id: str, cfg: BusConfig | None = None) -> None:
        self.nc = nc
        self.js = nc.jetstream(timeout=JS_API_TIMEOUT_S)
        self.cfg = cfg or BusConfig()
        self.names = RunNames(run_id, self.cfg.partitions)
        self._obs: ObjectStore | None = None
        self._state: RunState | None = None
        self.duplicates: dict[DuplicateVerdict, int] = dict.fromkeys(DuplicateVerdict, 0)

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
        wait_s: float = 30.0,
    ) -> Bus:
        """Connect (url defaults to `cfg.bus.url`; BusConnectError after `wait_s`) and, unless `ensure=False`,
        create the run's streams."""
        target = url or cfg.bus.url
        if not target:
            raise BusError("no NATS url: pass one or set bus.url (see rlbus.bus.resolve_bus_url)")
        nc = await _connect(cfg.bus, target, name, wait_s=wait_s)
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
    ) -> Opening[Bus]:
        """`async with Bus.connect(cfg, url, name) as bus:` (or `bus = await Bus.connect(...)`)."""
        return Opening(cls.open(cfg, url, name, ensure, storage))

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

    async def ensure_streams(self, storage: str = "file") -> None:
        """Create or update the work-queue streams (every partition), the DLQ and the blob store. Idempotent,
        so retried while JetStream cannot answer (a cluster still forming: tests/test_bus_cluster_forming.py)."""
        st = _storage(storage)
        await with_retry("ensure streams", lambda: self._ensure_streams(st), nc=self.nc)

    async def _ensure_streams(self, st: js_api.StorageType) -> None:
        await ensure_work_streams(self.js, self.names, st, self.cfg.stream_replicas)
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
                bucket,
                config=js_api.ObjectStoreConfig(
                    storage=storage or js_api.StorageType.FILE, replicas=self.cfg.stream_replicas
                ),
            )
        return self._obs

    async def stream_depth(self, stage: Stage | str) -> int:
        """Messages in the stage's stream: queued or handed out but not yet acked."""
        infos = [await self.js.stream_info(stream) for stream in self.names.streams(stage)]
        return sum(int(info.state.messages) for info in infos)

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
            self._state = await RunState.open(
                self.js, self.names, storage=self.cfg.storage, nc=self.nc, replicas=self.cfg.stream_replicas
            )
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
        hdrs[DIGEST_HEADER] = payload_digest(data)
        part = self.names.partition_of(partition_key(message) or hdrs[MSG_ID_HEADER])
        subject, stream = self.names.subject(stage, part), self.names.stream(stage, part)
        if len(data) <= self.inline_limit:
            ack = await self._js_publish(subject, data, stream, hdrs, what=f"publish {stage.value}")
            result = PublishResult(ack.stream, ack.seq, bool(ack.duplicate), len(data))
        else:
            result = await self._publish_claim(stage, subject, stream, data, hdrs, message.kind)
        if result.duplicate:
            await self._judge_duplicate(result, hdrs)
        return result

    async def _judge_duplicate(self, result: PublishResult, hdrs: dict[str, str]) -> None:
        """Counts a dropped duplicate by verdict (rlbus.bus.duplicates); a conflict is logged as an error."""
        verdict = await judge_duplicate(self.js, result.stream, result.seq, hdrs)
        if verdict is not None:
            self.duplicates[verdict] += 1

    async def _js_publish(
        self, subject: str, data: bytes, stream: str | None, hdrs: dict[str, str], what: str
    ) -> js_api.PubAck:
        timeout = 2.0 + len(data) / (2 * 1024 * 1024)  # short: a retry (deduplicated) beats a long wait
        return await with_retry(
            what,
            lambda: self.js.publish(subject, data, timeout=timeout, stream=stream, headers=dict(hdrs)),
            nc=self.nc,
        )

    async def _publish_claim(
        self, stage: Stage, subject: str, stream: str, data: bytes, hdrs: dict[str, str], kind: str
    ) -> PublishResult:
        obs = await self._object_store()
        # Always a fresh name: a duplicate publish must never overwrite the blob of a live claim.
        name = f"{stage.value}/{self.nc._nuid.next().decode()}"
        chunk = max(128 * 1024, min(1024 * 1024, self.inline_limit // 2))
        meta = js_api.ObjectMeta(name=name, options=js_api.ObjectMetaOptions(max_chunk_size=chunk))
        await with_retry(f"claim put {stage.value}", lambda: obs.put(name, data, meta=meta), nc=self.nc)
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
                await unless_disconnected(self.nc, lambda: self.js.get_msg(meta.stream, seq=seq))
            except NotFoundError:
                return "gone"
            info = await unless_disconnected(
                self.nc, lambda: self.js.consumer_info(meta.stream, meta.consumer)
            )
        except Exception as exc:  # the server is away again
            log.debug("bus.ack_check_failed", stream=meta.stream, error=f"{type(exc).__name__}: {exc}")
            return None
        delivered = int(info.delivered.stream_seq or 0) if info.delivered is not None else 0
        return "forgotten" if delivered < seq else "pending"

    async def _get_claim(self, name: str) -> bytes:
        try:
            obs = await self._object_store()
            return await read_object(self.js, obs, self.names.blobs_bucket, name)
        except (ObjectNotFoundError, BucketNotFoundError, NotFoundError) as exc:  # the object, or a chunk
            raise ClaimMissingError(
                f"claim-check object {name!r} is missing from {self.names.blobs_bucket}"
            ) from exc

    async def _delete_claim(self, name: str) -> None:
        try:
            obs = await self._object_store()
            await obs.delete(name)
        except ObjectNotFoundError:
            pass
        except Exception as exc:  # an orphan blob is only wasted space; never fail an ack for it
            log.warning("bus.claim_delete_failed", claim=name, error=str(exc))

    # ---------------------------------------------------------------- consume

    @overload
    async def consumer(
        self,
        stage: Stage | str,
        durable: str,
        expected: type[M],
        ack_wait_s: float | None = None,
        max_deliver: int | None = None,
        max_ack_pending: int = 1000,
    ) -> Consumer[M] | FanInConsumer[M]: ...

    @overload
    async def consumer(
        self,
        stage: Stage | str,
        durable: str,
        expected: None = None,
        ack_wait_s: float | None = None,
        max_deliver: int | None = None,
        max_ack_pending: int = 1000,
    ) -> Consumer[Message] | FanInConsumer[Message]: ...

    async def consumer(
        self,
        stage: Stage | str,
        durable: str,
        expected: type[Message] | None = None,
        ack_wait_s: float | None = None,
        max_deliver: int | None = None,
        max_ack_pending: int = 1000,
    ) -> Consumer[Any] | FanInConsumer[Any]:
        """Pull consumer on a stage (every partition of it, fetched from as one). `expected` defaults to the
        stage's message type.

        A work-queue stream allows one durable per stage: all replicas of a service share `durable`.
        """
        stage = Stage(stage)
        if not _NAME_RE.match(durable):
            raise ValueError(f"durable name {durable!r} must match {_NAME_RE.pattern}")
        ack_wait = float(ack_wait_s if ack_wait_s is not None else self.cfg.ack_wait_s)
        deliver = int(max_deliver if max_deliver is not None else self.cfg.max_deliver)
        expected_cls = expected if expected is not None else STAGE_MESSAGE[stage]
        parts = [
            await self._partition_consumer(
                stage, k, durable, expected_cls, ack_wait, deliver, max_ack_pending
            )
            for k in range(self.names.partitions)
        ]
        return parts[0] if len(parts) == 1 else FanInConsumer(parts)

    async def _partition_consumer(
        self,
        stage: Stage,
        partition: int,
        durable: str,
        expected: type[M],
        ack_wait: float,
        deliver: int,
        max_ack_pending: int,
    ) -> Consumer[M]:
        stream, subject = self.names.stream(stage, partition), self.names.subject(stage, partition)
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
        return Consumer(self, stage, durable, expected, sub, ack_wait, deliver)

    async def delete_consumer(self, stage: Stage | str, durable: str) -> bool:
        """Remove a stage's durable consumer from every partition (un-acked items return to the queue for the
        next one); whether any was there."""
        found = False
        for stream in self.names.streams(stage):
            try:
                found = bool(await self.js.delete_consumer(stream, durable)) or found
            except NotFoundError:
                pass
        return found

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
