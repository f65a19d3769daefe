"""Retrying idempotent NATS requests through a server restart or a reconnect (publishes carry a
Nats-Msg-Id, acks can be repeated), with backoff up to a deadline.

An attempt on a client that disconnects ends at once and is retried on the new connection
(rlbus.bus.disconnects says why).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from nats.aio.client import Client
from nats.errors import (
    ConnectionReconnectingError,
    NoRespondersError,
    OutboundBufferLimitError,
    StaleConnectionError,
)
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.errors import APIError, NoStreamResponseError, ServiceUnavailableError

from rlbus.bus.connect import log
from rlbus.bus.disconnects import ConnectionLostError, unless_disconnected

PUBLISH_DEADLINE_S = 30.0
"""How long a publish (or ack) keeps retrying through a reconnect before it raises."""
RETRY_CAP_S = 0.5
"""Longest pause between tries. Most retryable errors come back at once (no responders while a clustered
stream elects its leader, 4-9 s in nats-server): a longer pause would only add to the stall."""
T = TypeVar("T")


# Errors after which the same request may simply be sent again: the server was away or not ready.
# A request written to a dying socket is lost silently and surfaces as a timeout.
RETRYABLE = (
    NatsTimeoutError,
    asyncio.TimeoutError,
    NoRespondersError,
    NoStreamResponseError,
    ServiceUnavailableError,
    ConnectionReconnectingError,
    OutboundBufferLimitError,
    StaleConnectionError,
    ConnectionLostError,
)

# JetStream answers that are no decision about the request, by error code: the same request, sent again
# later, is stored or acked as a duplicate. A clustered stream leader stages a msg id when it proposes the
# message, and answers a second publish of that id 10158 until the proposal applies: the retry of a publish
# whose first answer was lost while a server died (seen in tests/test_bus_cluster.py).
TRANSIENT_API_ERRORS = {
    10158: "duplicate message id is in process",
    10167: "too many requests",
}


def is_retryable(exc: BaseException) -> bool:
    """Whether the request that raised `exc` may simply be sent again (pure: the policy of with_retry)."""
    if isinstance(exc, RETRYABLE):
        return True
    return isinstance(exc, APIError) and exc.err_code in TRANSIENT_API_ERRORS


async def with_retry(
    what: str,
    fn: Callable[[], Awaitable[T]],
    deadline_s: float = PUBLISH_DEADLINE_S,
    nc: Client | None = None,
) -> T:
    """Run `fn` until it succeeds, retrying retryable errors with backoff for up to `deadline_s`; an attempt
    on client `nc` ends at once when `nc` disconnects.

    Only for idempotent requests: publishes carry a Nats-Msg-Id, acks can be repeated. What counts as
    retryable is `is_retryable`.
    """
    deadline = time.monotonic() + deadline_s
    delay, tries = 0.1, 0
    while True:
        try:
            return await unless_disconnected(nc, fn)
        except Exception as exc:
            if not is_retryable(exc) or time.monotonic() + delay >= deadline:
                raise
            tries += 1
            report = log.warning if tries == 1 else log.debug  # once per request, not every half second
            report("bus.retry", what=what, error=f"{type(exc).__name__}: {exc}", retry_in_s=round(delay, 2))
            await asyncio.sleep(delay)
            delay = min(delay * 2, RETRY_CAP_S)
