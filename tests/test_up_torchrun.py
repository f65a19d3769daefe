"""`rlbus up trainer.n_gpus_per_node=2`: the learner is a torchrun job of two ranks (gloo on this CPU box),
FSDP2 over both, and the run trains every step once and ends cleanly."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from e2e_utils import FAST, up_command

from rlbus.config import load_config
from rlbus.config.warnings import inert_key_warnings
from rlbus.launcher import cpu_thread_env, learner_command, rollout_gpu, service_processes
from rlbus.metrics_log import read_metrics

STEPS = 6


def test_learner_command_and_replica_placement() -> None:
    assert learner_command(load_config(None, [])) is None
    cmd = learner_command(load_config(None, ["trainer.n_gpus_per_node=4"]))
    assert cmd[1:4] == ["-m", "torch.distributed.run", "--standalone"] and cmd[4:6] == [
        "--nproc-per-node",
        "4",
    ]
    assert not any(
        "n_gpus_per_node" in w for w in inert_key_warnings(load_config(None, ["trainer.n_gpus_per_node=2"]))
    )
    assert any("trainer.nnodes=2" in w for w in inert_key_warnings(load_config(None, ["trainer.nnodes=2"])))
    # learner on GPUs 0-1 of 4: replicas on 2, 3, 2, ...; of 2: they share the learner's, round robin
    assert [rollout_gpu(i, 2, 4) for i in range(3)] == [2, 3, 2]
    assert [rollout_gpu(i, 2, 2) for i in range(3)] == [0, 1, 0]
    assert rollout_gpu(0, 2, 0) is None


def test_cpu_cores_are_split_between_the_services_that_compute_on_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr("os.sched_getaffinity", lambda _pid: set(range(8)))
    cfg = load_config(None, ["rollout.replicas=3"])
    procs = service_processes(cfg, tmp_path / "c.yaml", tmp_path)
    threads = cpu_thread_env(cfg, procs, gpus=0)  # learner + 3 replicas on 8 cores: 2 each
    assert {name: env["OMP_NUM_THREADS"] for name, env in threads.items()} == {
        "learner": "2",
        "rollout-0": "2",
        "rollout-1": "2",
        "rollout-2": "2",
        "reward": "1",
    }
    on_gpu = cpu_thread_env(load_config(None, ["trainer.device=cuda", "rollout.device=cuda"]), procs, gpus=1)
    assert on_gpu == {}  # nothing computes on the cores
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert cpu_thread_env(cfg, procs, gpus=0) == {}  # the user's setting wins


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_up_runs_the_learner_under_torchrun(tmp_path: Path, nats_url: str, run_id: str) -> None:
    done = subprocess.run(
        up_command(
            tmp_path,
            nats_url,
            run_id,
            *FAST,
            f"trainer.total_training_steps={STEPS}",
            "trainer.n_gpus_per_node=2",
            "trainer.save_freq=-1",
            "trainer.test_freq=-1",
            "trainer.val_before_train=false",
        ),
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=360,
    )
    log = (tmp_path / "runs" / run_id / "logs" / "learner.log").read_text()
    assert done.returncode == 0, f"{done.stdout[-2000:]}\n{done.stderr[-2000:]}\n{log[-3000:]}"
    rows = [r for r in read_metrics(tmp_path / "runs" / run_id) if "timing/step_s" in r]
    assert [int(r["step"]) for r in rows] == list(range(1, STEPS + 1))
    assert all(r["learner/ranks"] == 2.0 for r in rows)
    assert "Traceback" not in log
