"""A forged rollout heartbeat (schema-valid, refreshed every 1.5 s, as any client with the bus could write it)
costs the run at most one rendezvous timeout in total: a replica joins a weight group only by answering the
group's roll call, a silent one is a suspect called again only after a doubling backoff, and the suspect
list outlives the learner process (it is in the run's KV)."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest
from e2e_utils import Run, make_config

from rlbus.bus import Bus, LocalNatsServer
from rlbus.learner.push_members import SUSPECTS_FACT
from rlbus.messages import Heartbeat

FORGE_S = 60.0
PUSH_TIMEOUT_S = 30.0
RUN = [
    "trainer.total_training_steps=100000",  # stopped by the test once the forger is done
    "data.train_batch_size=8",
    "rollout.n=4",
    "trainer.async_level=1",
    "trainer.val_before_train=false",
    "trainer.test_freq=0",
    f"trainer.weight_push_timeout_s={PUSH_TIMEOUT_S:.0f}",
]


async def forge(cfg, seconds: float) -> int:
    """Write a ghost replica's heartbeat every 1.5 s for `seconds`; returns how many were written."""
    async with Bus.connect(cfg, name="forger", ensure=False) as bus:
        state = await bus.state()
        beats, end = 0, time.monotonic() + seconds
        while time.monotonic() < end:
            await state.heartbeat(
                Heartbeat(
                    run_id=cfg.run.id,
                    service="rollout",
                    instance_id="rollout-ghost",
                    time=time.time(),
                    status="ready",
                    device="cpu",
                    incarnation="ghost",
                    stats={"weight_ranks": 1.0},
                )
            )
            beats += 1
            await asyncio.sleep(1.5)  # the forger's pace, not a wait for the system
        return beats


async def stored_suspects(cfg) -> dict:
    async with Bus.connect(cfg, name="inspector", ensure=False) as bus:
        return await (await bus.state()).get_json(SUSPECTS_FACT, {})


def log_events(path: Path, event: str) -> list[dict]:
    out = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if row.get("event") == event:
            out.append(row)
    return out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_forged_heartbeat_for_60s_costs_at_most_one_rendezvous_timeout(
    private_nats: LocalNatsServer, run_id: str, tmp_path: Path
) -> None:
    cfg = make_config(private_nats.url, run_id, tmp_path, [*RUN, "logging.json_logs=true"])
    with Run(cfg) as run:
        run.wait_for_step(3, 150)
        before = run.metrics()[-1]["step"]
        beats = asyncio.run(forge(cfg, FORGE_S))
        after = run.metrics()[-1]["step"]
        suspects = asyncio.run(stored_suspects(cfg))
        assert run.learner.alive, run.logs("learner")
    log = run.learner.log_path
    calls = [c for c in log_events(log, "roll call") if "rollout-ghost" in c.get("called", [])]
    ghost_s = sum(float(c["seconds"]) for c in calls if "rollout-ghost" in c.get("silent", []))
    failures = log_events(log, "weight push failed; will re-form the group")
    print(
        f"forged {beats} beats over {FORGE_S:.0f}s: {len(calls)} roll calls named the ghost, {ghost_s:.1f}s "
        f"waited on it, {len(failures)} failed pushes; steps {before} -> {after}"
    )
    assert beats >= 30
    assert calls, (
        "the ghost was never called to the roll: the forged beat was not seen, this test checked nothing"
    )
    assert all("rollout-ghost" in c["silent"] for c in calls)
    assert ghost_s <= PUSH_TIMEOUT_S, f"the ghost cost {ghost_s:.1f}s of roll calls"
    assert not failures, failures
    assert after - before >= 20, "training went on while the ghost beat"
    assert suspects.get("rollout-ghost", {}).get("incarnation") == "ghost", suspects
