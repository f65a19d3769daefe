"""A NATS cluster that rlbus starts itself on this host (`bus.cluster_size` servers): NATS's own
clustering, routes between the servers and a JetStream meta-group, so R3 streams survive a server's death.

Each server is a LocalNatsServer with a name, a route port and routes to all the others; clients get every
server's URL and reconnect across them. Ports are fixed at the first start, so a killed server restarts
where its peers expect it, with its own store.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

from rlbus.bus.local_server import DEFAULT_MAX_PAYLOAD, LocalNatsError, LocalNatsServer, _free_port

CLUSTER_NAME = "rlbus"


class LocalNatsCluster:
    """`with LocalNatsCluster(run_dir, 3) as c: ... c.url ...`; `c.servers[i].kill()` / `.start()` in fault
    tests. `extra_config` (e.g. an authorization block) goes into every server's config; with one, the
    readiness probe connects with `probe_credentials` (a user allowed JetStream's INFO request)."""

    def __init__(
        self,
        run_dir: str | Path,
        size: int = 3,
        max_payload_bytes: int = DEFAULT_MAX_PAYLOAD,
        extra_config: str = "",
        start_timeout_s: float = 30.0,
        probe_credentials: tuple[str, str] | None = None,
    ) -> None:
        if size < 3 or size % 2 == 0:
            raise ValueError(f"a cluster needs an odd number of servers, at least 3 (got {size})")
        self.run_dir = Path(run_dir)
        self.start_timeout_s = start_timeout_s
        self.probe_credentials = probe_credentials  # (user, password) the readiness probe connects as
        client_ports = [_free_port() for _ in range(size)]
        route_ports = [_free_port() for _ in range(size)]
        routes = ", ".join(f'"nats-route://127.0.0.1:{p}"' for p in route_ports)
        self.servers = [
            LocalNatsServer(
                self.run_dir / f"n{i}",
                port=client_ports[i],
                max_payload_bytes=max_payload_bytes,
                start_timeout_s=start_timeout_s,
                extra_config=(
                    f"server_name: rlbus-n{i}\n"
                    f"cluster {{ name: {CLUSTER_NAME}, listen: 127.0.0.1:{route_ports[i]}, routes: [{routes}] }}\n"
                    f"{extra_config}"
                ),
            )
            for i in range(size)
        ]

    @property
    def url(self) -> str:
        """Every server's URL, comma-separated (rlbus.bus.connect takes the list)."""
        return ",".join(s.url for s in self.servers)

    def start(self) -> LocalNatsCluster:
        """Starts the servers one after another (each listens at once; a server started from a thread would
        die with that thread: LocalNatsServer ties its child to its starter), then waits for the JetStream
        meta leader."""
        try:
            for server in self.servers:
                server.start()
            self.wait_for_jetstream()
        except BaseException:
            self.stop()
            raise
        return self

    def wait_for_jetstream(self) -> None:
        """Until the cluster answers JetStream requests (a meta leader is elected); LocalNatsError after the
        start timeout. Runs its own event loop in a thread: callers may be inside one."""
        outcome: list[BaseException | None] = []
        thread = threading.Thread(target=lambda: outcome.append(_run(self._await_meta_leader())))
        thread.start()
        thread.join()
        if outcome and outcome[0] is not None:
            raise LocalNatsError(f"the cluster elected no JetStream leader: {outcome[0]}")

    async def _await_meta_leader(self) -> None:
        import nats

        deadline = time.monotonic() + self.start_timeout_s
        user, password = self.probe_credentials or (None, None)
        nc = await nats.connect(
            servers=[s.url for s in self.servers],
            connect_timeout=2,
            max_reconnect_attempts=5,
            user=user,
            password=password,
        )
        try:
            js = nc.jetstream()
            while True:
                try:
                    await js.account_info()
                    return
                except Exception:
                    if time.monotonic() > deadline:
                        raise
                    await asyncio.sleep(0.2)
        finally:
            await nc.close()

    def stop(self) -> None:
        for server in self.servers:
            server.stop()

    def __enter__(self) -> LocalNatsCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _run(coro: Coroutine[Any, Any, None]) -> BaseException | None:
    try:
        asyncio.run(coro)
    except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
        return exc
    return None
