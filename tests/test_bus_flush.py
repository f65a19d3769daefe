"""`flush_through` against a real NATS server: nats-py writes a flush's PING ahead of the commands still in its
pending buffer, so a plain flush after a subscribe puts PING on the wire before SUB, and its PONG says nothing
about the subscription; `flush_through` ends with a PING that follows them."""

from __future__ import annotations

from collections.abc import Iterable

import nats
from nats.aio.client import Client
from nats.aio.msg import Msg

from rlbus.bus.flush import flush_through


def _record_the_wire(nc: Client) -> list[bytes]:
    """The protocol lines this client writes from now on, in order (the real transport still writes them)."""
    wire: list[bytes] = []
    transport = nc._transport
    assert transport is not None
    write, writelines = transport.write, transport.writelines

    def write_one(data: bytes) -> None:
        wire.append(bytes(data))
        write(data)

    def write_many(chunks: Iterable[bytes]) -> None:
        chunks = list(chunks)
        wire.extend(bytes(c) for c in chunks)
        writelines(chunks)

    transport.write = write_one  # type: ignore[method-assign]
    transport.writelines = write_many  # type: ignore[method-assign]
    return wire


def _kinds(wire: list[bytes]) -> list[str]:
    return [line.split(b" ", 1)[0].strip().decode() for line in wire]


async def _ignore(_msg: Msg) -> None:
    return None


async def test_a_plain_flush_can_pass_its_subscription_and_flush_through_cannot(nats_url: str) -> None:
    nc = await nats.connect(nats_url)
    try:
        wire = _record_the_wire(nc)
        await nc.subscribe("rlbus-test.flush.plain", cb=_ignore)
        await nc.flush()
        # the premise of flush_through: nats-py's own flush put its PING ahead of the SUB
        assert _kinds(wire) == ["PING", "SUB"], wire
        wire.clear()
        await nc.subscribe("rlbus-test.flush.through", cb=_ignore)
        await flush_through(nc)
        kinds = _kinds(wire)
        assert "SUB" in kinds and kinds[-1] == "PING", (
            wire
        )  # the last PING, whose PONG we waited for, follows
    finally:
        await nc.close()
