"""Health and metrics endpoints every service serves when `run.health_port` > 0.

    metrics = ServiceMetrics("rollout")
    health = HealthServer(cfg.run.health_port, "rollout", metrics=metrics)
    health.start()                 # port 0: does nothing (disabled)
    ...                            # connect to the bus, load the model
    health.set_ready(True)         # /readyz turns 200
    metrics.items_in.inc()
    metrics.set_queue_depth("prompts", 12)
    health.stop()

Routes: `/healthz` 200 while the process runs; `/readyz` 200 after `set_ready(True)`, else 503 (with
the reason given to `set_ready`); `/metrics` Prometheus text of the service's own registry.

The server is stdlib `ThreadingHTTPServer` in a daemon thread, not a coroutine on the service's event
loop: a learner step or a model load that blocks the loop for minutes must not make the liveness probe
fail and get the pod killed. Under torchrun (LOCAL_RANK set), only local rank 0 serves, since every
rank of a node would otherwise try to bind the same port.
"""

from __future__ import annotations

import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

WEIGHT_PUSH_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class ServiceMetrics:
    """The standard rlbus metrics of one service, in a registry of its own, all labelled `service`.

    The `service`-bound children are attributes (`items_in.inc()`, `policy_version.set(3)`,
    `weight_push_seconds.observe(1.2)`); `queue_depth(stage)` gives the gauge of one stage.
    """

    def __init__(self, service: str, registry: CollectorRegistry | None = None) -> None:
        self.service = service
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        r = self.registry
        svc = ["service"]
        self._items_in = Counter("rlbus_items_in_total", "Work items received", svc, registry=r)
        self._items_out = Counter("rlbus_items_out_total", "Work items published", svc, registry=r)
        self._errors = Counter("rlbus_errors_total", "Errors handled without stopping", svc, registry=r)
        self._dead_letters = Counter(
            "rlbus_dead_letters_total", "Messages sent to the dead-letter subject", svc, registry=r
        )
        self._queue_depth = Gauge(
            "rlbus_queue_depth", "Messages waiting in a stage's queue", ["service", "stage"], registry=r
        )
        self._tokens_per_second = Gauge("rlbus_tokens_per_second", "Token throughput", svc, registry=r)
        self._policy_version = Gauge("rlbus_policy_version", "Policy version in use", svc, registry=r)
        self._policy_lag = Gauge(
            "rlbus_policy_lag", "Policy versions between the learner and the data in use", svc, registry=r
        )
        self._weight_push = Histogram(
            "rlbus_weight_push_seconds",
            "Time of one weight push (send or receive)",
            svc,
            registry=r,
            buckets=WEIGHT_PUSH_BUCKETS,
        )
        self.items_in = self._items_in.labels(service=service)
        self.items_out = self._items_out.labels(service=service)
        self.errors = self._errors.labels(service=service)
        self.dead_letters = self._dead_letters.labels(service=service)
        self.tokens_per_second = self._tokens_per_second.labels(service=service)
        self.policy_version = self._policy_version.labels(service=service)
        self.policy_lag = self._policy_lag.labels(service=service)
        self.weight_push_seconds = self._weight_push.labels(service=service)

    def queue_depth(self, stage: str) -> Gauge:
        return self._queue_depth.labels(service=self.service, stage=stage)

    def set_queue_depth(self, stage: str, depth: float) -> None:
        self.queue_depth(stage).set(depth)

    def render(self) -> bytes:
        """The registry in Prometheus text exposition format."""
        return generate_latest(self.registry)


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        self._respond(send_body=True)

    def do_HEAD(self) -> None:  # noqa: N802
        self._respond(send_body=False)

    def _respond(self, send_body: bool) -> None:
        owner = self.server.owner
        path = self.path.split("?", 1)[0].rstrip("/") or "/"
        content_type = "text/plain; charset=utf-8"
        if path == "/healthz":  # alive; a refused service says so, and a restart would not help it
            refused = owner.refused
            status, body = (
                200,
                (
                    f"refused {owner.service_name}: {refused}" if refused else f"ok {owner.service_name}"
                ).encode()
                + b"\n",
            )
        elif path == "/readyz":
            ready, reason = owner.ready_state
            status = 200 if ready else 503
            body = (
                f"ready {owner.service_name}\n" if ready else f"not ready {owner.service_name}: {reason}\n"
            ).encode()
        elif path == "/metrics":
            try:
                status, body, content_type = 200, owner.metrics.render(), CONTENT_TYPE_LATEST
            except Exception as exc:  # a broken collector must not kill the health thread
                status, body = 500, f"metrics failed: {exc!r}\n".encode()
        else:
            status, body = 404, b"not found: try /healthz, /readyz, /metrics\n"
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        if send_body:
            self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:  # probes every few seconds: stay quiet
        return


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], owner: HealthServer) -> None:
        self.owner = owner
        super().__init__(address, _Handler)


class HealthServer:
    """`/healthz`, `/readyz`, `/metrics` on `port` (0 = disabled: start/stop do nothing)."""

    def __init__(
        self,
        port: int,
        service_name: str,
        *,
        metrics: ServiceMetrics | None = None,
        host: str = "0.0.0.0",
    ) -> None:
        if port < 0:
            raise ValueError(f"health port must be >= 0 (0 = off), got {port}")
        self.service_name = service_name
        self.metrics = metrics if metrics is not None else ServiceMetrics(service_name)
        self.host = host
        self._requested_port = port
        self._ready = False
        self._reason = "starting"
        self._refused = ""
        self._lock = threading.Lock()
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def enabled(self) -> bool:
        """False when the port is 0, or under torchrun on a local rank other than 0."""
        return self._requested_port > 0 and os.environ.get("LOCAL_RANK", "0") == "0"

    @property
    def port(self) -> int:
        """The bound port while running, else the configured one."""
        return self._server.server_address[1] if self._server is not None else self._requested_port

    @property
    def running(self) -> bool:
        return self._server is not None

    @property
    def ready(self) -> bool:
        return self._ready

    @property
    def ready_state(self) -> tuple[bool, str]:
        with self._lock:
            return self._ready, self._reason

    def set_ready(self, ready: bool = True, reason: str = "") -> None:
        """Marks the service ready (or not, with a reason shown in /readyz's 503 body)."""
        with self._lock:
            self._ready = bool(ready)
            self._reason = "" if ready else (reason or "marked not ready")

    @property
    def refused(self) -> str:
        """Why the service refused its configuration, or "" while it has not."""
        with self._lock:
            return self._refused

    def set_refused(self, reason: str) -> None:
        """The service will not serve with this configuration: never ready, and /healthz says why."""
        with self._lock:
            self._ready, self._refused = False, reason or "refused its configuration"
            self._reason = f"refused: {self._refused}"

    def start(self) -> HealthServer:
        """Binds and serves in a daemon thread. Raises OSError (naming the port) if it is taken."""
        if not self.enabled or self._server is not None:
            return self
        try:
            server = _Server((self.host, self._requested_port), self)
        except OSError as exc:
            raise OSError(
                exc.errno,
                f"{self.service_name}: cannot serve health on {self.host}:{self._requested_port}: "
                f"{exc.strerror} (set run.health_port to a free port, or 0 to turn it off)",
            ) from exc
        self._server = server
        self._thread = threading.Thread(
            target=server.serve_forever,
            kwargs={"poll_interval": 0.2},
            name=f"rlbus-health-{self.service_name}",
            daemon=True,
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stops serving and frees the port; safe to call twice or when never started."""
        server, thread = self._server, self._thread
        self._server, self._thread = None, None
        if server is None:
            return
        server.shutdown()
        server.server_close()
        if thread is not None:
            thread.join(timeout=5)

    def __enter__(self) -> HealthServer:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    async def __aenter__(self) -> HealthServer:
        return self.start()

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


__all__ = ["HealthServer", "ServiceMetrics", "WEIGHT_PUSH_BUCKETS"]
