"""Two GPUs of one host (the nvidia-h200-x2 kind): the weight push over NCCL between processes on different
GPUs, and the FSDP2 learner across both. The same guarantees the CPU tests check over gloo
(tests/test_weight_sync.py, tests/test_fsdp.py), on the transport and sharding a multi-GPU run uses.
`gpu`-marked (`make test-gpu`); skipped below two GPUs."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
import test_fsdp as fsdp_cases
import torch
from helpers_tiny import build_tiny_model
from test_weight_sync import HOST, RDV_S, Replicas, push

from rlbus.weight_sync import WeightSender, WeightSyncError

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs of one host"),
]


@pytest.mark.timeout(180)
def test_nccl_push_to_a_replica_on_the_other_gpu_is_bit_exact_and_survives_a_killed_peer() -> None:
    """Learner side on cuda:0, replicas on cuda:1: two versions arrive bit-exact over one NCCL group; a
    replica that SIGKILLs itself mid-push makes the send fail within the timeout, and a new epoch with a
    fresh replica works."""
    timeout_s = 20.0
    replicas = Replicas(["a", "b"], device="cuda:1")
    sender = WeightSender(
        "nccl", HOST, timeout_s=timeout_s, bucket_bytes=4096, device="cuda:0", rendezvous_timeout_s=RDV_S
    )
    nccl = {"a": {"backend": "nccl"}, "b": {"backend": "nccl"}}
    try:
        push(sender, replicas, 1, epoch=1, ranks={"a": 1}, new_group=True, **nccl)
        push(sender, replicas, 2, epoch=1, ranks={"a": 1}, new_group=False, **nccl)
        assert replicas.collect(2, timeout=120) == {("a", 1): ("ok", ""), ("a", 2): ("ok", "")}

        dying = {"a": {"backend": "nccl"}, "b": {"backend": "nccl", "die_after_bucket": 1}}
        with pytest.raises(WeightSyncError):
            push(sender, replicas, 3, epoch=2, ranks={"a": 1, "b": 2}, new_group=True, **dying)
        assert sender.last_send_seconds < timeout_s + 5
        assert replicas.collect(1, timeout=120)[("a", 3)][0] == "error"
        replicas.procs["b"].join(30)
        assert replicas.procs["b"].exitcode == -signal.SIGKILL

        push(sender, replicas, 4, epoch=3, ranks={"a": 1}, new_group=True, **nccl)
        assert replicas.collect(1, timeout=120) == {("a", 4): ("ok", "")}
    finally:
        sender.close()
        replicas.close()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny_two_gpus"))


@pytest.fixture(scope="module")
def two_gpu_results(tiny: Path) -> dict:
    """The FSDP2 scenarios of tests/test_fsdp.py, as two ranks on cuda:0 and cuda:1 (NCCL)."""
    return fsdp_cases.run_two_ranks(tiny, "cuda", wait_s=300.0, join_s=60.0)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", list(fsdp_cases.SCENARIOS))
def test_fsdp_over_two_gpus_matches_one_gpu(tiny: Path, two_gpu_results: dict, name: str) -> None:
    """Same loss, statistics and updated weights as one GPU on the same global batch (fp32 model; the
    comparison's tolerances are test_fsdp's)."""
    one = fsdp_cases.run_scenario(fsdp_cases.scenario_config(str(tiny), name, "cuda"), "cuda")
    fsdp_cases.assert_same_update(one, two_gpu_results[name])
