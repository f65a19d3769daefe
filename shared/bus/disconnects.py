"""Requests that end when their connection drops.

A request written just before the connection drops is lost with the socket, and nats-py lets it wait out
its whole timeout (2 s for a publish, 5 s for a KV read). Every service has such requests in flight, so one
NATS restart stalled the run for ~5 s; so did one written while the client was reconnecting.
`unless_disconnected` sends a request only on a live connection and ends its wait the moment that
connection drops, so the caller's retry goes out on the next one.
"""

from __future__ import annotations

import asyncio
import time
import weakref
from collections.abc import Awaitable, Callable
from typing import TypeVar

from nats.aio.client import Client

T = TypeVar("T")


RECENT_RECONNECT_S = (
    3.0  # this soon after a reconnect, the server and the other clients may still be settling
)


class ConnectionLostError(ConnectionError):
    """The client disconnected while this request waited for its answer; the request was lost."""


class Disconnects:
    """One client's connections: an event per connection, set when it drops, and whether one is up."""

    def __init__(self) -> None:
        self._current = asyncio.Event()
        self.connected = asyncio.Event()
        self.connected.set()  # first asked for a client rlbus.bus.connect returned connected
        self.reconnected_at: float | None = None  # monotonic time of the last reconnect (None: never)

    def fire(self) -> None:
        """Called from the client's disconnected callback."""
        self.connected.clear()
        dropped, self._current = self._current, asyncio.Event()
        dropped.set()

    def reconnected(self) -> None:
        """Called from the client's reconnected callback."""
        self.reconnected_at = time.monotonic()
        self.connected.set()

    def recently_reconnected(self, within_s: float = RECENT_RECONNECT_S) -> bool:
        """Whether the client came back less than `within_s` ago (or is away now): the server may have just
        restarted (forgetting deliveries), and other clients may still be reconnecting."""
        return self.since_reconnect() < within_s

    def since_reconnect(self) -> float:
        """Seconds since the client last came back (0 while it is away, infinity if it never left)."""
        if not self.connected.is_set():
            return 0.0
        return float("inf") if self.reconnected_at is None else time.monotonic() - self.reconnected_at

    def current(self) -> asyncio.Event:
        """The event of the connection a request sent now goes out on."""
        return self._current


_DISCONNECTS: weakref.WeakKeyDictionary[Client, Disconnects] = weakref.WeakKeyDictionary()


def disconnects_of(nc: Client) -> Disconnects:
    """The Disconnects of `nc` (rlbus.bus.connect fires it)."""
    found = _DISCONNECTS.get(nc)
    if found is None:
        found = _DISCONNECTS[nc] = Disconnects()
    return found


async def unless_disconnected(nc: Client | None, request: Callable[[], Awaitable[T]]) -> T:
    """Send `request()` once `nc` is connected; raise ConnectionLostError as soon as that connection drops
    before the answer comes."""
    if nc is None:
        return await request()
    links = disconnects_of(nc)
    await links.connected.wait()
    dropped = links.current()
    task = asyncio.ensure_future(request())
    waiter = asyncio.ensure_future(dropped.wait())
    try:
        await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiter.cancel()
        if not task.done():  # the connection dropped first, or we are being cancelled
            task.cancel()
            await asyncio.wait({task})  # let it finish cancelling; never raises
    if task.cancelled():
        raise ConnectionLostError("the connection dropped before the answer came")
    return task.result()
