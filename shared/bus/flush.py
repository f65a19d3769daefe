"""A flush after which the server has processed every command sent before it.

nats-py (2.16) writes a flush's PING straight to the socket, ahead of the commands still in its pending buffer
(`Client._send_ping` against `_send_command`): after `subscribe` then `flush`, the wire carries PING, then SUB.
The server can answer PONG before it has the subscription, and a request from another connection in that
window is told "no responders" (a roll call found a listening replica silent: test_roll_call in CI,
2026-12-07). The first flush's wait for its PONG lets the client's flusher task write the pending buffer; the
second flush's PING then follows those commands on the wire, so its PONG comes after the server processed
them.
"""

from __future__ import annotations

from nats.aio.client import Client

FLUSH_TIMEOUT_S = 10  # nats-py's own default (whole seconds: its signature takes an int)


async def flush_through(nc: Client, timeout_s: int = FLUSH_TIMEOUT_S) -> None:
    """Return once the server has processed what this client sent before the call (module docstring)."""
    await nc.flush(timeout_s)
    await nc.flush(timeout_s)
