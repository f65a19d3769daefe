"""Shared fixtures: a real NATS server with JetStream, unique run ids, a config pointing at both.

Tests never mock NATS. The shared server on 127.0.0.1:4222 is used when it answers; otherwise one
LocalNatsServer is started for the session. Each test gets its own run id, so its streams never
collide with another test or another agent, and the run's streams are deleted afterwards.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from rlbus.bus import Bus, LocalNatsServer
from rlbus.bus.local_server import DEFAULT_URL, jetstream_server_at
from rlbus.config.schema import RlbusConfig


@pytest.fixture(scope="session")
def nats_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """URL of a JetStream-enabled NATS server for the whole session."""
    if jetstream_server_at("127.0.0.1", 4222):
        yield DEFAULT_URL
        return
    with LocalNatsServer(tmp_path_factory.mktemp("nats-session")) as server:
        yield server.url


async def _delete_run(url: str, run_id: str) -> None:
    cfg = RlbusConfig(run={"id": run_id}, bus={"url": url})
    bus = await asyncio.wait_for(Bus.open(cfg, name="test-cleanup", ensure=False), 10)
    try:
        await bus.delete_run()
    finally:
        await bus.close()


@pytest.fixture
def run_id(request: pytest.FixtureRequest) -> Iterator[str]:
    """A run id unique to this test; whatever the test left under it on `nats_url` is deleted after."""
    rid = f"t{uuid.uuid4().hex[:12]}"
    yield rid
    if "nats_url" in request.fixturenames:
        url = request.getfixturevalue("nats_url")

        def cleanup() -> None:  # own thread, own loop: never disturbs the test's event loop
            with contextlib.suppress(Exception):
                asyncio.run(_delete_run(url, rid))

        t = threading.Thread(target=cleanup, name="rlbus-test-cleanup", daemon=True)
        t.start()
        t.join(15)


@pytest.fixture
def bus_config(nats_url: str, run_id: str, tmp_path: Path) -> RlbusConfig:
    """Default config, namespaced to this test's run and pointed at the session's server."""
    return RlbusConfig(run={"id": run_id, "dir": tmp_path / "runs"}, bus={"url": nats_url})


@pytest.fixture
async def bus(bus_config: RlbusConfig) -> AsyncIterator[Bus]:
    """An open Bus with the run's streams created; the run is deleted after the test."""
    b = await Bus.open(bus_config, name="test")
    try:
        yield b
    finally:
        with contextlib.suppress(Exception):
            await b.delete_run()
        await b.close()


@pytest.fixture
def private_nats(tmp_path: Path) -> Iterator[LocalNatsServer]:
    """A NATS server of this test alone (own port, own storage, 8 MiB max_payload): restart or kill it freely."""
    server = LocalNatsServer(tmp_path / "private-nats", max_payload_bytes=8 * 1024 * 1024)
    server.start()
    try:
        yield server
    finally:
        server.stop()


_SUMMARY = pytest.StashKey[list[str]]()


@pytest.fixture
def summary_line(request: pytest.FixtureRequest):
    """Adds a line to the end of the pytest run's output (measured figures a report should carry, such
    as the fault-injection run's wall-time ratio), shown even when the test's own output is captured."""
    return request.config.stash.setdefault(_SUMMARY, []).append


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    for line in config.stash.get(_SUMMARY, []):
        terminalreporter.write_line(line)
