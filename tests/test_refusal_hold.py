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
from pathlib import Path

import pytest
from e2e_utils import up_command
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


@pytest.mark.timeout(120)
def test_rlbus_up_in_a_holding_container_still_hears_its_services_refuse(
    tmp_path: Path, nats_url: str, run_id: str
) -> None:
    """An image sets the hold for every process, `rlbus up` included. Its services must still exit 2 on a
    refusal (the launcher gives them `exit`), so `up` learns of it, stops the run, and then holds itself."""
    tests_dir = str(Path(__file__).parent)
    env = {
        **os.environ,
        "RLBUS_RUN__ON_REFUSAL": "hold",
        "PYTHONPATH": tests_dir + ":" + os.environ.get("PYTHONPATH", ""),
    }
    command = up_command(
        tmp_path, nats_url, run_id, "reward.type=function", "reward.function=reward_fns:two_arguments"
    )
    proc = subprocess.Popen(command, env=env, cwd=tmp_path, stderr=subprocess.PIPE, text=True)
    said = []
    try:
        assert proc.stderr is not None
        for line in proc.stderr:  # ends when up exits; it holds instead, so we stop at the line we wait for
            said.append(line)
            if "holding instead of exiting" in line:
                break
        assert any("reward refused its configuration" in line for line in said), "".join(said[-20:])
    finally:
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=60)
    assert rc == 2
