"""HealthServer over real HTTP on a free port: /healthz, /readyz, /metrics, disabled mode, restart."""

from __future__ import annotations

import socket
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from rlbus.health import HealthServer, ServiceMetrics


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(port: int, path: str) -> tuple[int, str, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as resp:
            return resp.status, resp.headers.get("Content-Type", ""), resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.headers.get("Content-Type", ""), err.read().decode()


@pytest.fixture
def server(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    srv = HealthServer(free_port(), "rollout", host="127.0.0.1").start()
    yield srv
    srv.stop()


def test_healthz_is_up_and_readyz_follows_set_ready(server: HealthServer) -> None:
    assert server.running and server.enabled
    assert get(server.port, "/healthz")[0] == 200
    status, _, body = get(server.port, "/readyz")
    assert status == 503 and "not ready rollout" in body
    server.set_ready(True)
    assert get(server.port, "/readyz")[:1] == (200,)
    server.set_ready(False, "weights lost")
    status, _, body = get(server.port, "/readyz")
    assert status == 503 and "weights lost" in body
    assert get(server.port, "/nope")[0] == 404
    assert get(server.port, "/healthz?verbose=1")[0] == 200


def test_metrics_are_prometheus_text_labelled_by_service(server: HealthServer) -> None:
    m = server.metrics
    m.items_in.inc(3)
    m.items_out.inc()
    m.errors.inc()
    m.dead_letters.inc(2)
    m.set_queue_depth("prompts", 7)
    m.queue_depth("scored").set(1)
    m.tokens_per_second.set(123.5)
    m.policy_version.set(4)
    m.policy_lag.set(1)
    m.weight_push_seconds.observe(0.3)
    status, ctype, body = get(server.port, "/metrics")
    assert status == 200 and ctype.startswith("text/plain")
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(body)
        for s in fam.samples
    }
    svc = (("service", "rollout"),)
    assert samples[("rlbus_items_in_total", svc)] == 3
    assert samples[("rlbus_items_out_total", svc)] == 1
    assert samples[("rlbus_errors_total", svc)] == 1
    assert samples[("rlbus_dead_letters_total", svc)] == 2
    assert samples[("rlbus_queue_depth", (("service", "rollout"), ("stage", "prompts")))] == 7
    assert samples[("rlbus_queue_depth", (("service", "rollout"), ("stage", "scored")))] == 1
    assert samples[("rlbus_tokens_per_second", svc)] == 123.5
    assert samples[("rlbus_policy_version", svc)] == 4
    assert samples[("rlbus_policy_lag", svc)] == 1
    assert samples[("rlbus_weight_push_seconds_count", svc)] == 1
    assert samples[("rlbus_weight_push_seconds_sum", svc)] == pytest.approx(0.3)


def test_registries_are_per_service() -> None:
    a, b = ServiceMetrics("reward"), ServiceMetrics("ref")
    a.items_in.inc()
    assert b"reward" in a.render() and b"reward" not in b.render()


def test_port_zero_is_disabled() -> None:
    srv = HealthServer(0, "ref")
    assert not srv.enabled
    with srv:
        assert not srv.running
    srv.stop()


def test_only_local_rank_zero_serves(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert not HealthServer(free_port(), "learner").start().running


def test_stop_frees_the_port_and_restart_works(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    port = free_port()
    srv = HealthServer(port, "learner", host="127.0.0.1").start()
    assert get(port, "/healthz")[0] == 200
    srv.stop()
    srv.stop()  # idempotent
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2)
    srv.start()
    try:
        assert get(port, "/healthz")[0] == 200
    finally:
        srv.stop()


def test_taken_port_names_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(OSError, match=f"127.0.0.1:{port}.*run.health_port"):
            HealthServer(port, "reward", host="127.0.0.1").start()


async def test_async_context_manager_serves_while_loop_is_blocked(monkeypatch: pytest.MonkeyPatch) -> None:
    import time

    monkeypatch.delenv("LOCAL_RANK", raising=False)
    async with HealthServer(free_port(), "learner", host="127.0.0.1") as srv:
        srv.set_ready()
        time.sleep(0.05)  # the loop is blocked; the thread still answers
        assert get(srv.port, "/readyz")[0] == 200
    assert not srv.running
