"""In a container (RLBUS_RUN__ON_REFUSAL=hold, set by rlbus's images) a service that refuses its configuration
does not exit 2 into a restart loop: it says why once, stays up with /healthz reporting the refusal and
/readyz 503, and exits 2 when stopped. Without the variable it exits 2 at once, as `rlbus up` expects."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
from test_health import free_port

BAD = ["rollout", "rollout.temprature=0.5"]  # a misspelt key: refused with the key named


def _get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=2) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


@pytest.mark.timeout(120)
def test_a_refused_service_holds_unready_instead_of_exiting() -> None:
    port = free_port()
    env = {**os.environ, "RLBUS_RUN__ON_REFUSAL": "hold", "RLBUS_RUN__HEALTH_PORT": str(port)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "rlbus.cli", *BAD], env=env, stderr=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, (
                f"exited {proc.returncode}: {proc.stderr.read() if proc.stderr else ''}"
            )
            try:
                status, body = _get(port, "/healthz")
                break
            except OSError:
                assert time.monotonic() < deadline, "the held service never served /healthz"
                time.sleep(0.1)
        assert status == 200 and body.startswith("refused rollout:") and "temprature" in body
        status, body = _get(port, "/readyz")
        assert status == 503 and "refused" in body
    finally:
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=30)
    assert rc == 2
    assert proc.stderr is not None and "holding instead of exiting" in proc.stderr.read()


def test_without_the_hold_a_refusal_exits_2_at_once() -> None:
    env = {k: v for k, v in os.environ.items() if k != "RLBUS_RUN__ON_REFUSAL"}
    out = subprocess.run(
        [sys.executable, "-m", "rlbus.cli", *BAD], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 2 and "temprature" in out.stderr
