"""Transport selection over a table of placements, and what a placement that cannot work does to a run."""

from __future__ import annotations

from pathlib import Path

import pytest
from e2e_utils import rlbus_up

from rlbus.weight_transport import (
    DevicePlace,
    PlacementError,
    check_config_placement,
    choose_transport,
    group_backend,
)

CPU = DevicePlace("cpu")
GPU_A = DevicePlace("cuda", "GPU-aaaa")
GPU_B = DevicePlace("cuda", "GPU-bbbb")

# (choice, learner, replica, replica engine takes IPC) -> transport, or the words the refusal must contain
TABLE = [
    ("auto", GPU_A, GPU_A, True, "cuda_ipc"),
    ("auto", GPU_A, GPU_A, False, "gloo"),  # e.g. a vLLM replica on the learner's GPU: NCCL would refuse
    ("auto", GPU_A, GPU_B, True, "nccl"),
    ("auto", CPU, CPU, True, "gloo"),
    ("auto", GPU_A, CPU, True, "gloo"),
    ("auto", CPU, GPU_A, True, "gloo"),
    ("gloo", GPU_A, GPU_A, True, "gloo"),
    ("gloo", GPU_A, GPU_B, True, "gloo"),
    ("cuda_ipc", GPU_A, GPU_A, True, "cuda_ipc"),
    ("cuda_ipc", GPU_A, GPU_B, True, PlacementError),
    ("cuda_ipc", GPU_A, CPU, True, PlacementError),
    ("cuda_ipc", GPU_A, GPU_A, False, PlacementError),
    ("nccl", GPU_A, GPU_B, True, "nccl"),
    ("nccl", GPU_A, GPU_A, True, PlacementError),  # two NCCL ranks on one GPU
    ("nccl", GPU_A, CPU, True, PlacementError),
    ("nccl", CPU, GPU_A, True, PlacementError),
    ("nccl", CPU, CPU, True, PlacementError),
]


@pytest.mark.parametrize(("choice", "learner", "replica", "ipc", "expected"), TABLE)
def test_transport_for_each_placement(choice, learner, replica, ipc, expected) -> None:
    if expected is PlacementError:
        with pytest.raises(PlacementError, match="trainer.weight_sync_backend"):
            choose_transport(choice, learner, replica, "rollout-0", replica_ipc=ipc)
    else:
        assert choose_transport(choice, learner, replica, "rollout-0", replica_ipc=ipc) == expected


def test_same_index_other_uuid_is_another_gpu() -> None:
    """Indices are per process (CUDA_VISIBLE_DEVICES); only the UUID says 'same GPU'."""
    assert (
        choose_transport("auto", DevicePlace.parse("cuda:GPU-aaaa"), DevicePlace.parse("cuda:GPU-bbbb"))
        == "nccl"
    )
    assert DevicePlace.parse(str(GPU_A)) == GPU_A
    assert DevicePlace.parse("") == CPU  # a heartbeat without a device (older replica) reads as CPU


def test_one_group_serves_all_non_ipc_replicas() -> None:
    assert group_backend(["cuda_ipc", "cuda_ipc"]) is None
    assert group_backend(["cuda_ipc", "nccl", "nccl"]) == "nccl"
    assert group_backend(["nccl", "gloo"]) == "gloo"  # one torch group has one backend: stage them all
    assert group_backend(["gloo"]) == "gloo"


@pytest.mark.parametrize(
    ("choice", "learner", "rollout", "gpus", "words"),
    [
        ("nccl", "auto", "auto", 0, "trainer.device resolves to cpu"),
        ("cuda_ipc", "cuda", "cpu", 1, "rollout.device resolves to cpu"),
        ("nccl", "auto", "auto", 1, "NCCL refuses"),
        ("cuda_ipc", "cuda:0", "cuda:1", 2, "needs the rollout on the learner's GPU"),
    ],
)
def test_config_placement_refusals_name_the_key(choice, learner, rollout, gpus, words) -> None:
    with pytest.raises(PlacementError, match="trainer.weight_sync_backend") as info:
        check_config_placement(choice, learner, rollout, gpus)
    assert words in str(info.value)


@pytest.mark.parametrize(
    ("choice", "learner", "rollout", "gpus"),
    [
        ("auto", "auto", "auto", 1),
        ("gloo", "cuda", "cpu", 1),
        ("nccl", "cuda:0", "cuda:1", 2),
        ("cuda_ipc", "auto", "auto", 1),
    ],
)
def test_config_placements_that_can_work_pass(choice, learner, rollout, gpus) -> None:
    check_config_placement(choice, learner, rollout, gpus)


def test_impossible_forced_transport_is_refused_at_start(tmp_path: Path, nats_url: str, run_id: str) -> None:
    """On this CPU box `nccl` can never work: `rlbus up` refuses before starting anything, naming the key."""
    done = rlbus_up(tmp_path, nats_url, run_id, "trainer.weight_sync_backend=nccl", timeout=60)
    assert done.returncode == 2, done.stderr
    assert "trainer.weight_sync_backend=nccl" in done.stderr
    assert "set trainer.weight_sync_backend=auto" in done.stderr
    assert not (tmp_path / "runs" / run_id / "logs").exists()  # no service was started


def test_push_failing_for_one_reason_stops_the_run_with_it(
    tmp_path: Path, nats_url: str, run_id: str
) -> None:
    """An injected fault (a weight-group address this host does not have) fails every push the same way:
    after trainer.weight_push_max_failures of them the run stops, and the console says why."""
    done = rlbus_up(
        tmp_path,
        nats_url,
        run_id,
        "trainer.weight_sync_host=192.0.2.1",
        "trainer.weight_push_max_failures=2",
        "trainer.total_training_steps=30",
        "trainer.test_freq=-1",
        "trainer.val_before_train=false",
        "trainer.weight_push_timeout_s=5",
        timeout=300,
    )
    assert done.returncode == 4, (done.stdout, done.stderr)
    assert "failed 2 times in a row for the same reason" in done.stderr
    assert "192.0.2.1" in done.stderr
    assert "trainer.weight_push_max_failures=2" in done.stderr
