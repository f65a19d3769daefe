"""The learner's real weight pusher reaches per-tensor (SGLang) replicas: they heartbeat `per_tensor_wire`,
the announcement gives them a `tensor_group` of their own, and the pusher broadcasts every tensor in
announcement order on it.

The replica side here is SGLang's own rendezvous (`init_custom_process_group`, mirrored by
rlbus.weight_sync.per_tensor.join_per_tensor_group) and its receive loop (one `dist.broadcast` per
tensor into a buffer of the announced dtype and shape), over a real NATS server and real gloo groups.
The same push against a live SGLang server is tests/test_sglang_contract.py.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from rlbus.bus import Bus
from rlbus.bus.roll_call import answer_roll_calls
from rlbus.config import RlbusConfig
from rlbus.learner.weight_push import WeightPusher
from rlbus.logs import get_logger
from rlbus.messages import Heartbeat, WeightAnnouncement, decode, encode
from rlbus.service import ServiceContext

REPLICA = Path(__file__).with_name("per_tensor_replica.py")


def _weights(version: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(version)
    return {
        "embed.weight": torch.randn(16, 8, generator=g),
        "layer.bias": torch.randn(8, generator=g).to(torch.bfloat16),
        "head.weight": torch.randn(4, 8, generator=g),
    }


async def _announcement(bus: Bus, version: int, timeout_s: float = 30) -> WeightAnnouncement:
    state = await bus.state()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        raw = await state.get_announcement()
        if raw:
            ann = decode(raw, WeightAnnouncement)
            if ann.version == version:
                return ann
        await asyncio.sleep(0.05)
    raise AssertionError(f"no announcement of version {version}")


@pytest.mark.timeout(120)
async def test_learner_pusher_reaches_a_per_tensor_replica(
    bus: Bus, bus_config: RlbusConfig, tmp_path: Path
) -> None:
    cfg = bus_config.model_copy(deep=True)
    cfg.trainer.weight_push_timeout_s = 60
    state = await bus.state()
    ctx = ServiceContext(cfg, "learner", "learner", bus, state, asyncio.Event(), get_logger("test-learner"))
    replica_id = "sglang-0"
    await state.heartbeat(
        Heartbeat(
            run_id=cfg.run.id,
            service="rollout",
            instance_id=replica_id,
            time=time.time(),
            status="ready",
            stats={"weight_ranks": 1.0, "per_tensor_wire": 1.0},
            device="cpu",
            incarnation="a",
        )
    )
    # the replica process below reads its announcement from a file: the test answers its roll calls for it
    await answer_roll_calls(bus.nc, bus.names, replica_id, "a", get_logger("test-replica"))
    pusher = WeightPusher(ctx, torch.device("cpu"))
    await pusher.start()
    replica = None
    try:
        pushes = []
        for version in (1, 2):  # the second reuses the group the first formed
            weights = _weights(version)
            push = asyncio.create_task(pusher.push(lambda w=weights: iter(w.items()), version))
            ann = await _announcement(bus, version)
            if replica is None:
                (tmp_path / "ann").write_bytes(encode(ann))
                replica = subprocess.Popen(
                    [sys.executable, str(REPLICA), replica_id, str(tmp_path / "ann"), "2", str(tmp_path)]
                )
            assert await asyncio.wait_for(push, 90), pusher.status
            got_file = tmp_path / f"{version - 1}.pt"
            deadline = time.monotonic() + 60
            while not got_file.exists():
                assert replica.poll() is None, f"the replica exited with {replica.returncode}"
                assert time.monotonic() < deadline, "the replica did not receive the version"
                await asyncio.sleep(0.05)
            got = torch.load(got_file)
            pushes.append(ann)
            assert ann.tensor_group is not None and ann.tensor_group.ranks == {replica_id: 1}
            assert ann.ranks == {} and ann.ipc_replicas == []  # not in the bucketed group
            assert ann.timeout_s == 60  # the replica waits inside the push as long as the learner does
            assert got.keys() == weights.keys()
            for name, t in weights.items():
                assert torch.equal(got[name], t), name
        assert pushes[0].epoch == pushes[1].epoch
        assert pushes[0].tensor_group == pushes[1].tensor_group  # one group per epoch
        assert replica is not None and replica.wait(30) == 0
    finally:
        pusher.close()
        if replica is not None and replica.poll() is None:
            replica.kill()
