"""One NATS user per process, each publishing only what its role publishes (rlbus.bus.roles), against a real
nats-server configured by the same block `rlbus up` writes: an anonymous client is refused, a rollout cannot
publish ready groups or another replica's heartbeat, the reader only reads; and `rlbus up` with no bus.url runs
a whole run on such a server, its status readable with the run's reader."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from e2e_utils import prompt_work, up_command

from rlbus.bus import Bus, BusConnectError, LocalNatsServer, Stage
from rlbus.bus.roles import authorization_block, make_users, read_reader
from rlbus.bus.subjects import RunNames
from rlbus.config import RlbusConfig, load_config
from rlbus.messages import Heartbeat, encode


def _as(cfg: RlbusConfig, user) -> RlbusConfig:
    out = cfg.model_copy(deep=True)
    out.bus.user, out.bus.password = user.user, user.password
    return out


async def _refused_publish(bus: Bus, subject: str, data: bytes) -> bool:
    """True when the server refused the publish (no ack comes back: the permission violation dropped it)."""
    try:
        await bus.js.publish(subject, data, timeout=0.7)
    except Exception:  # noqa: BLE001 - nats' timeout or no-responders: either way nothing was stored
        return True
    return False


@pytest.mark.timeout(120)
async def test_each_role_publishes_only_what_it_owns(run_id: str, tmp_path: Path) -> None:
    names = RunNames(run_id)
    users = make_users(names, {"learner": "learner", "rollout-0": "rollout", "reward-0": "reward"})
    by = {u.instance or u.role: u for u in users}
    server = LocalNatsServer(
        tmp_path / "nats", extra_config=authorization_block(users, names, needs_ref=False)
    )
    with server:
        cfg = RlbusConfig(
            run={"id": run_id, "dir": tmp_path}, bus={"url": server.url, "connect_timeout_s": 2}
        )
        with pytest.raises(BusConnectError, match="(?i)authorization"):
            await Bus.open(cfg, name="anonymous", ensure=False)
        wrong = cfg.model_copy(deep=True)
        wrong.bus.user, wrong.bus.password = by["rollout-0"].user, "guessed"
        with pytest.raises(BusConnectError, match="(?i)authorization"):
            await Bus.open(wrong, name="guesser", ensure=False)

        async with Bus.connect(_as(cfg, by["learner"]), name="learner") as learner:
            await learner.publish(Stage.PROMPTS, prompt_work(run_id, 0), msg_id="p0")
            state = await learner.state()
            await state.set_policy_version(1)
        async with Bus.connect(_as(cfg, by["rollout-0"]), name="rollout-0") as rollout:
            consumer = await rollout.consumer(Stage.PROMPTS, "rollout", ack_wait_s=5)
            [d] = await consumer.fetch(1, timeout=5)
            assert await d.ack()
            traj = b"not checked by the server"
            assert not await _refused_publish(rollout, rollout.names.subject(Stage.TRAJECTORIES), traj)
            for stage in (Stage.READY, Stage.SCORED, Stage.PROMPTS):
                assert await _refused_publish(rollout, rollout.names.subject(stage), b"forged"), stage
            state = await rollout.state()
            hb = Heartbeat(run_id=run_id, service="rollout", instance_id="rollout-0", time=0.0)
            await state.heartbeat(hb)  # its own key
            ghost = hb.model_copy(update={"instance_id": "rollout-ghost"})
            assert await _refused_publish(
                rollout, f"$KV.{names.state_bucket}.hb.rollout.rollout-ghost", encode(ghost)
            )
            assert await _refused_publish(rollout, f"$KV.{names.state_bucket}.policy.version", b"\x05")
            assert await _refused_publish(rollout, f"$JS.API.STREAM.DELETE.{names.stream(Stage.READY)}", b"")
        async with Bus.connect(_as(cfg, by["reward-0"]), name="reward-0") as reward:
            assert not await _refused_publish(reward, reward.names.subject(Stage.READY), b"x")  # no ref here
            assert await _refused_publish(reward, reward.names.subject(Stage.PROMPTS), b"forged")
        async with Bus.connect(_as(cfg, by["reader"]), name="status", ensure=False) as reader:
            assert await reader.stream_depth(Stage.READY) == 1
            assert [hb.instance_id for hb in await (await reader.state()).heartbeats("rollout")] == [
                "rollout-0"
            ]
            assert await _refused_publish(reader, reader.names.subject(Stage.PROMPTS), b"forged")
        async with Bus.connect(_as(cfg, by["learner"]), name="learner", ensure=False) as learner:
            assert await learner.stream_depth(Stage.TRAJECTORIES) == 1  # only the rollout's own
            assert await learner.stream_depth(Stage.PROMPTS) == 0
            await learner.delete_run()


@pytest.mark.timeout(240)
def test_rlbus_up_runs_on_its_own_server_with_a_user_per_process(run_id: str, tmp_path: Path) -> None:
    """No bus.url: `rlbus up` starts its own server with the roles (not the open one on 4222), the run trains
    to the end, every service connected as its own user, and `rlbus status` reads with the reader."""
    run_dir = tmp_path / "runs" / run_id
    done = subprocess.run(
        up_command(
            tmp_path,
            None,
            run_id,
            "trainer.total_training_steps=3",
            "data.train_batch_size=4",
            "trainer.val_before_train=false",
            "trainer.test_freq=0",
        ),
        capture_output=True,
        text=True,
        timeout=200,
        cwd=tmp_path,
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    cfg = load_config(run_dir / "config.yaml", [])
    assert cfg.bus.url and not cfg.bus.url.endswith(":4222"), cfg.bus.url
    assert cfg.bus.password is None, "no secret is written into the run's config"
    assert read_reader(run_dir / "nats") is not None
    assert oct((run_dir / "nats" / "reader.json").stat().st_mode & 0o777) == "0o600"
    for log in ("learner", "reward", "rollout-0"):
        text = (run_dir / "logs" / f"{log}.log").read_text(errors="replace")
        assert "Permissions Violation" not in text and "permissions violation" not in text.lower(), text[
            -2000:
        ]
    server_log = (run_dir / "nats" / "nats-server.log").read_text(errors="replace")
    assert "Permissions Violation" not in server_log, server_log[-3000:]
