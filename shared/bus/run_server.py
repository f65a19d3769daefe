"""The NATS bus `rlbus up` starts for a run of its own: one server, or a local cluster (`bus.cluster_size`)."""

from __future__ import annotations

from pathlib import Path

from rlbus.bus.local_cluster import LocalNatsCluster
from rlbus.bus.local_server import LocalNatsServer, single_run_server
from rlbus.config.schema import BusConfig


def start_run_server(
    cfg: BusConfig,
    run_dir: str | Path,
    authorization: str = "",
    probe_credentials: tuple[str, str] | None = None,
) -> tuple[str, LocalNatsServer | LocalNatsCluster]:
    """A server of the run's own (storage in `<run_dir>/nats`, so a resumed run finds its streams), or a
    cluster of `bus.cluster_size` servers (its URL lists them all; the readiness probe connects with
    `probe_credentials` when `authorization` closes the bus)."""
    if cfg.cluster_size > 1:
        cluster = LocalNatsCluster(
            Path(run_dir) / "nats",
            cfg.cluster_size,
            cfg.max_payload_bytes,
            extra_config=authorization,
            probe_credentials=probe_credentials,
        ).start()
        return cluster.url, cluster
    server = single_run_server(cfg, run_dir, authorization)
    return server.url, server
