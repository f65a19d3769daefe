"""The pull side of a work queue: validated deliveries, each settled exactly once (ack, nak, term, dead letter)."""

from __future__ import annotations

import asyncio
import functools
import time
from typing import Generic, Protocol, TypeVar, cast

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import JetStreamContext

from rlbus.bus.connect import log
from rlbus.bus.disconnects import disconnects_of, unless_disconnected
from rlbus.bus.headers import (
    ACK_AFTER_RECONNECT_S,
    ACK_IGNORED_TRIES,
    ACK_TIMEOUT_S,
    CLAIM_HEADER,
    ClaimMissingError,
)
from rlbus.bus.retry import PUBLISH_DEADLINE_S, RETRYABLE
from rlbus.bus.subjects import Stage
from rlbus.codec import CodecError
from rlbus.messages import Message, MessageError, decode

M = TypeVar("M", bound=Message)  # the message type a consumer's stage carries


class ConsumerBus(Protocol):
    """What a consumer asks of its bus: its client (an ack ends when it disconnects), claim-check bytes, the
    DLQ, and an ack's fate after a timeout."""

    nc: Client

    async def _get_claim(self, name: str) -> bytes: ...

    async def _delete_claim(self, name: str) -> None: ...

    async def _ack_fate(self, msg: Msg) -> str | None: ...

    async def _publish_dead_letter(self, stage: Stage, msg: Msg, reason: str, consumer: str) -> bool: ...


class Delivery(Generic[M]):
    """One validated work item. Settle it exactly once: ack, nak, term or dead_letter."""

    def __init__(self, consumer: Consumer[M], msg: Msg, message: M, claim: str | None) -> None:
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

    @property
    def ack_subject(self) -> str:
        """Where this delivery's ack goes: whoever holds it may name it (a heartbeat's `holding`), so that
        a NAK sent there once the holder is gone hands the work back at once (rlbus.bus.hand_back)."""
        return str(self.raw.reply or "")

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
        nc = self._consumer.bus.nc
        # A server that just restarted may have lost this delivery and then ignores its ack without a word:
        # the first try then waits briefly before asking the stream what became of the item.
        wait_s = min(timeout, ACK_AFTER_RECONNECT_S) if disconnects_of(nc).recently_reconnected() else timeout
        while True:
            try:
                await unless_disconnected(nc, functools.partial(self.raw.ack_sync, timeout=wait_s))
                return True
            except RETRYABLE as exc:
                error = f"{type(exc).__name__}: {exc}"
            fate = await self._consumer.bus._ack_fate(self.raw)
            if fate == "gone":
                return True  # the ack got through; only its answer was lost
            if fate == "pending" and wait_s >= timeout:  # a short first wait after a reconnect is no strike
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
            wait_s = timeout
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


class Consumer(Generic[M]):
    """A pull consumer on one stage's work queue; replicas sharing `durable` share the work."""

    def __init__(
        self,
        bus: ConsumerBus,
        stage: Stage,
        durable: str,
        expected: type[M],
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

    async def fetch(self, batch: int = 1, timeout: float = 5.0) -> list[Delivery[M]]:
        """Up to `batch` valid deliveries, waiting at most `timeout` s for the first; [] on timeout.

        Invalid messages met on the way are dead-lettered and do not count; the wait goes on.
        """
        deadline = time.monotonic() + timeout
        out: list[Delivery[M]] = []
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
            # together: each invalid one is a dead-letter publish and a term, round trips that 2,000 junk
            # messages made one after another
            accepted = await asyncio.gather(*(self._accept(msg) for msg in msgs))
            out += [delivery for delivery in accepted if delivery is not None]
        return out

    async def _accept(self, msg: Msg) -> Delivery[M] | None:
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
            message = cast(M, decode(data, self.expected))  # decode checked it is an `expected`
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
