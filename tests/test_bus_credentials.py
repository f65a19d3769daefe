"""The compose stack's closed bus (rlbus.bus.stack_credentials): one NKey per role, written by the one-shot
`rlbus bus-credentials`, against a real nats-server configured with the auth.conf it writes. An anonymous
client is refused; the rollout key may publish trajectories but not ready groups; keys survive a second
run of the command while the server's users are rewritten for the config's run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from test_bus_roles import _refused_publish

from rlbus.bus import Bus, BusConnectError, LocalNatsServer, Stage
from rlbus.bus.stack_credentials import AUTH_FILE, SEED_FILE, SERVER_DIR, STACK_ROLES
from rlbus.config import RlbusConfig


def _bus_credentials(into: Path, run_id: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rlbus.cli", "bus-credentials", "--into", str(into), f"run.id={run_id}"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )


@pytest.mark.timeout(120)
async def test_each_role_key_publishes_only_what_its_role_owns(run_id: str, tmp_path: Path) -> None:
    creds = tmp_path / "creds"
    _bus_credentials(creds, "an-earlier-run")
    seeds = {role: (creds / role / SEED_FILE).read_bytes() for role in STACK_ROLES}
    assert all(oct((creds / role / SEED_FILE).stat().st_mode & 0o777) == "0o600" for role in STACK_ROLES)
    _bus_credentials(creds, run_id)  # a second `up` with another run: same keys, users for this run
    assert {role: (creds / role / SEED_FILE).read_bytes() for role in STACK_ROLES} == seeds
    auth = (creds / SERVER_DIR / AUTH_FILE).read_text()
    assert run_id in auth and "an-earlier-run" not in auth
    assert not any(seed.decode() in auth for seed in seeds.values())  # the server holds public keys only

    server = LocalNatsServer(tmp_path / "nats", extra_config=auth)
    with server:
        cfg = RlbusConfig(
            run={"id": run_id, "dir": tmp_path}, bus={"url": server.url, "connect_timeout_s": 2}
        )
        with pytest.raises(BusConnectError, match="(?i)authorization"):
            await Bus.open(cfg, name="anonymous", ensure=False)

        def as_role(role: str) -> RlbusConfig:
            out = cfg.model_copy(deep=True)
            out.bus.nkeys_seed = creds / role / SEED_FILE
            return out

        async with Bus.connect(as_role("learner"), name="learner"):
            pass  # creates the streams, as the learner does first in a run
        async with Bus.connect(as_role("rollout"), name="rollout-0") as rollout:
            assert not await _refused_publish(rollout, rollout.names.subject(Stage.TRAJECTORIES), b"t")
            assert await _refused_publish(rollout, rollout.names.subject(Stage.READY), b"forged")
        async with Bus.connect(as_role("reader"), name="status", ensure=False) as reader:
            assert await _refused_publish(reader, reader.names.subject(Stage.PROMPTS), b"forged")
