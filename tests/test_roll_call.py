"""The learner's roll call against a real NATS server: a replica that listens answers with its incarnation; a
replica whose process is gone (nobody subscribed) is known silent at once, not after the join window; right
after the caller's own connection came back, a replica that starts listening within the window still counts."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from rlbus.bus import Bus, LocalNatsServer
from rlbus.bus.disconnects import disconnects_of
from rlbus.bus.roll_call import answer_roll_calls, roll_call
from rlbus.config import RlbusConfig
from rlbus.logs import get_logger

WINDOW_S = 30.0  # far longer than any answer takes: a call that ran into it waited for nobody


async def test_a_listening_replica_answers_and_a_gone_one_costs_no_window(bus: Bus, bus_config) -> None:
    log = get_logger("test-roll-call")
    async with Bus.connect(bus_config, name="replica-r0", ensure=False) as replica:
        await answer_roll_calls(replica.nc, replica.names, "r0", "inc-a", log)
        t0 = time.monotonic()
        answered = await roll_call(bus.nc, bus.names, ["r0", "r-gone"], WINDOW_S, log, reconnect_grace_s=0.0)
        took = time.monotonic() - t0
    assert answered == {"r0": "inc-a"}
    assert took < WINDOW_S / 2, f"the roll call waited {took:.1f} s for a replica nobody stands behind"


async def test_just_after_a_nats_restart_a_replica_still_resubscribing_is_waited_for(
    private_nats: LocalNatsServer, tmp_path: Path
) -> None:
    log = get_logger("test-roll-call")
    cfg = RlbusConfig(run={"id": "roll-call", "dir": tmp_path / "runs"}, bus={"url": private_nats.url})
    async with Bus.connect(cfg, name="learner", ensure=False) as learner:
        private_nats.restart()
        back_by = time.monotonic() + 30
        while disconnects_of(learner.nc).since_reconnect() == float("inf"):
            assert time.monotonic() < back_by, "the client did not reconnect to the restarted server in 30 s"
            await asyncio.sleep(0.05)  # polling for the reconnect the restart causes
        async with Bus.connect(cfg, name="replica-r1", ensure=False) as replica:
            call = asyncio.ensure_future(roll_call(learner.nc, learner.names, ["r1"], WINDOW_S, log))
            await asyncio.sleep(0.3)  # the replica is back 0.3 s after the call went out
            assert not call.done(), (
                "a caller that had just reconnected gave up on a replica before the window"
            )
            await answer_roll_calls(replica.nc, replica.names, "r1", "inc-b", log)
            assert await asyncio.wait_for(call, WINDOW_S) == {"r1": "inc-b"}


async def test_a_client_that_never_left_has_no_reconnect_to_count(bus: Bus) -> None:
    assert disconnects_of(bus.nc).since_reconnect() == float("inf")
