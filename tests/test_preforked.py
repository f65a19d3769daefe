"""Services forked from the preloaded server (rlbus.preforked) behave as fresh `python -m rlbus.cli`
processes: their own environment, log file, thread count, signals and exit codes."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest
from e2e_utils import wait_until

from rlbus.config import RlbusConfig, save_config
from rlbus.preforked import ForkedService


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1", **extra}


@pytest.mark.timeout(120)
def test_a_forked_command_gets_its_env_log_and_exit_code(tmp_path: Path) -> None:
    log = tmp_path / "config.log"
    ok = ForkedService(["config", "show", "run.id=forked-run"], _env(), log)
    assert ok.wait(90) == 0
    assert "forked-run" in log.read_text()

    bad = ForkedService(["config", "show", "trainer.no_such_key=1"], _env(), tmp_path / "bad.log")
    assert bad.wait(90) == 2  # what `python -m rlbus.cli` returns for a config error
    assert "trainer.no_such_key" in (tmp_path / "bad.log").read_text()


@pytest.mark.timeout(120)
def test_a_forked_service_takes_its_thread_count_and_stops_on_sigterm(
    bus_config: RlbusConfig, tmp_path: Path
) -> None:
    config = tmp_path / "config.yaml"
    save_config(bus_config, config)
    log = tmp_path / "reward.log"
    reward = ForkedService(
        ["reward", "--config", str(config), "--instance-id", "reward-forked"], _env(OMP_NUM_THREADS="1"), log
    )
    try:
        wait_until(lambda: "service started" in log.read_text(), 90, "the forked reward service to start")
        assert "torch_threads=1" in log.read_text()  # set in the server, re-applied in the child
        assert os.getsid(reward.pid) == reward.pid  # its own session, as start_new_session gives
        reward.send_signal(signal.SIGTERM)
        assert reward.wait(60) == 0, log.read_text()[-2000:]
        assert "service stopped" in log.read_text()
    finally:
        reward.kill()


@pytest.mark.timeout(120)
def test_a_killed_forked_service_reports_the_signal(bus_config: RlbusConfig, tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    save_config(bus_config, config)
    log = tmp_path / "reward.log"
    reward = ForkedService(["reward", "--config", str(config)], _env(), log)
    try:
        wait_until(lambda: "service started" in log.read_text(), 90, "the forked reward service to start")
        with pytest.raises(subprocess.TimeoutExpired):
            reward.wait(0.1)  # still running
        reward.kill()
        assert reward.wait(30) == -signal.SIGKILL  # as Popen reports it: the supervisor restarts on it
    finally:
        reward.kill()
