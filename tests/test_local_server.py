"""LocalNatsServer: starts with JetStream, keeps file-stored work across a restart, stops for good."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
from e2e_utils import prompt_work

from rlbus.bus import Bus, LocalNatsServer, Stage, resolve_bus_url
from rlbus.bus import local_server as local_server_mod
from rlbus.bus.local_server import (
    DEFAULT_URL,
    LocalNatsError,
    find_nats_server,
    jetstream_server_at,
    server_info,
)
from rlbus.config.schema import BusConfig, RlbusConfig


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.3)
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_binary_is_found() -> None:
    assert os.access(find_nats_server(), os.X_OK)


async def test_starts_serves_jetstream_restarts_with_messages_and_stops(tmp_path: Path, run_id: str) -> None:
    server = LocalNatsServer(tmp_path / "srv", max_payload_bytes=4 * 1024 * 1024)
    with server:
        port, pid = server.port, server.pid
        assert port and pid and server.running
        info = server_info("127.0.0.1", port)
        assert info and info["jetstream"] and info["max_payload"] == 4 * 1024 * 1024
        cfg = RlbusConfig(run={"id": run_id}, bus={"url": server.url})
        async with Bus.connect(cfg, name="t", storage="file") as bus:
            await bus.publish(Stage.PROMPTS, prompt_work(run_id, 1))
            await bus.publish(Stage.PROMPTS, prompt_work(run_id, 2))
            await (await bus.state()).set_policy_version(7)

        server.restart()
        assert server.port == port and server.pid != pid and server.running
        async with Bus.connect(cfg, name="t2", storage="file") as bus:
            assert await bus.stream_depth(Stage.PROMPTS) == 2
            consumer = await bus.consumer(Stage.PROMPTS, "rollout")
            got = await consumer.fetch(2, timeout=5)
            assert sorted(d.message.prompt_id for d in got) == ["p1", "p2"]  # type: ignore[attr-defined]
            for d in got:
                await d.ack()
            assert await (await bus.state()).get_policy_version() == 7
        last_pid = server.pid
    assert not server.running and server.pid is None
    assert last_pid is not None
    with pytest.raises(ProcessLookupError):
        os.kill(last_pid, 0)
    assert not _port_open(port)
    server.stop()  # stopping twice is harmless


def test_a_server_that_cannot_start_reports_its_log(tmp_path: Path) -> None:
    bad = LocalNatsServer(tmp_path / "bad", extra_config="this is { not a valid config")
    with pytest.raises(LocalNatsError, match="exited with code") as err:
        bad.start()
    assert "nats-server" in str(err.value)
    assert not bad.running


def test_two_servers_get_their_own_ports(tmp_path: Path) -> None:
    with LocalNatsServer(tmp_path / "a") as a, LocalNatsServer(tmp_path / "b") as b:
        assert a.port != b.port
        assert jetstream_server_at("127.0.0.1", a.port) and jetstream_server_at("127.0.0.1", b.port)


def test_resolve_bus_url(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    url, server = resolve_bus_url(BusConfig(url="nats://example:4222"), tmp_path)
    assert (url, server) == ("nats://example:4222", None)

    if jetstream_server_at("127.0.0.1", 4222):
        url, server = resolve_bus_url(BusConfig(), tmp_path)
        assert (url, server) == (DEFAULT_URL, None)

    # Nothing on 4222 (forced): a server of our own, with the configured max_payload.
    monkeypatch.setattr(local_server_mod, "jetstream_server_at", lambda *a, **k: False)
    url, server = resolve_bus_url(BusConfig(max_payload_bytes=2 * 1024 * 1024), tmp_path)
    assert server is not None
    try:
        assert url == server.url and url != DEFAULT_URL
        info = server_info("127.0.0.1", server.port)
        assert info and info["jetstream"] and info["max_payload"] == 2 * 1024 * 1024
        assert (tmp_path / "nats" / "nats-server.log").exists()
    finally:
        server.stop()
    assert not server.running
