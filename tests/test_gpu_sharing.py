"""Services that share a GPU run under an MPS daemon of the run's own when it is there (rlbus.gpu_sharing)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import structlog

from rlbus.config import load_config
from rlbus.config.warnings import inert_key_warnings
from rlbus.gpu_sharing import (
    PIPES_RECORD,
    MpsDaemon,
    RunMps,
    find_control,
    leftover_pipes,
    missing_control_problem,
    mps_plan,
    shares_a_gpu,
    sm_share_env,
    start_for_run,
)

CONTROL = "/usr/bin/nvidia-cuda-mps-control"


@pytest.mark.parametrize(
    ("setting", "shares", "control", "outside", "start"),
    [
        ("auto", True, CONTROL, False, True),
        ("mps", True, CONTROL, False, True),
        ("auto", True, None, False, False),  # not installed: time-sliced, as before
        ("auto", False, CONTROL, False, False),  # nothing shares a GPU
        ("time_slice", True, CONTROL, False, False),
        ("auto", True, CONTROL, True, False),  # the user's own daemon: the services find it themselves
        ("mps", True, CONTROL, True, False),
    ],
)
def test_the_run_starts_its_own_daemon_only_where_services_share_a_gpu_and_none_is_set_up(
    setting: str, shares: bool, control: str | None, outside: bool, start: bool
) -> None:
    plan = mps_plan(setting, shares, control, outside)  # type: ignore[arg-type]  # the Literal's values
    assert plan.start is start and plan.reason


def test_mps_without_its_binary_is_a_start_problem_only_when_asked_for() -> None:
    assert missing_control_problem("auto", None) is None
    assert missing_control_problem("mps", CONTROL) is None
    problem = missing_control_problem("mps", None)
    assert problem is not None and "run.gpu_sharing=mps" in problem


@pytest.mark.parametrize(
    ("overrides", "gpus", "shares"),
    [
        ([], 1, True),  # the default one-GPU run: the learner and the replica on cuda:0
        ([], 0, False),
        (["trainer.device=cpu"], 1, False),
        (["rollout.device=cpu"], 1, False),
        (["trainer.n_gpus_per_node=2"], 2, True),  # no GPU left: the replicas go on the learner's
        (["trainer.n_gpus_per_node=2"], 4, False),  # the replicas get GPUs 2 and 3
    ],
)
def test_which_runs_share_a_gpu(overrides: list[str], gpus: int, shares: bool) -> None:
    assert shares_a_gpu(load_config(None, overrides), gpus) is shares


def test_a_capped_learner_gets_its_sm_share_and_the_cap_is_inert_without_mps() -> None:
    cfg = load_config(None, ["run.gpu_sharing=mps", "run.mps_learner_sm_percent=60"])
    assert sm_share_env(cfg, "learner") == {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "60"}
    assert sm_share_env(cfg, "rollout") == {}  # uncapped: 100 is MPS's own default
    assert sm_share_env(cfg, "reward") == {}
    assert not [w for w in inert_key_warnings(cfg) if "sm_percent" in w]
    sliced = load_config(None, ["run.mps_learner_sm_percent=60"])
    assert [w for w in inert_key_warnings(sliced) if "sm_percent" in w] == [
        "run.mps_learner_sm_percent has no effect with run.gpu_sharing=time_slice (it shares SMs under MPS)"
    ]


def test_a_cap_reaches_the_services_under_the_user_s_own_daemon_too(tmp_path: Path) -> None:
    """CUDA_MPS_PIPE_DIRECTORY set by the user: the run starts no daemon, and its services (which inherit the
    variable) still get their SM cap; with no daemon at all they get nothing."""
    cfg = load_config(None, ["run.mps_learner_sm_percent=60"])
    cap = {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "60"}
    assert RunMps(None, outside_daemon=True).service_env(cfg, "learner") == cap
    assert RunMps(None, outside_daemon=False).service_env(cfg, "learner") == {}
    ours = MpsDaemon(tmp_path, CONTROL)
    assert RunMps(ours, outside_daemon=False).service_env(cfg, "learner") == {**ours.env, **cap}
    assert RunMps(ours, outside_daemon=False).service_env(cfg, "rollout") == ours.env


def test_a_cap_with_no_mps_under_the_services_is_warned_about_by_its_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """run.gpu_sharing=auto on a machine where nothing shares a GPU (here none): no daemon, and the cap set
    caps nothing, which the launcher's log says naming the key and why."""
    monkeypatch.delenv("CUDA_MPS_PIPE_DIRECTORY", raising=False)
    cfg = load_config(None, ["run.gpu_sharing=auto", "run.mps_rollout_sm_percent=40"])
    with structlog.testing.capture_logs() as logs:
        mps = start_for_run(cfg, 0, tmp_path)
    assert mps.daemon is None and mps.service_env(cfg, "rollout") == {}
    [warning] = [e for e in logs if e["log_level"] == "warning"]
    assert warning["event"].startswith("run.mps_rollout_sm_percent has no effect")
    assert warning["reason"] == "no GPU is shared by the learner and a replica"
    with structlog.testing.capture_logs() as logs:
        start_for_run(load_config(None, ["run.gpu_sharing=auto"]), 0, tmp_path)  # uncapped: nothing to say
    assert not [e for e in logs if e["log_level"] == "warning"]


def test_a_daemon_left_by_a_killed_launcher_is_found_by_the_next(tmp_path: Path) -> None:
    """A launcher killed before it quit its daemon leaves the record of its pipe folder in the run's logs: the
    next launcher of the run finds it while its control socket is there, and not once it is gone."""
    logs, pipes = tmp_path / "logs" / "mps", tmp_path / "rlbus-mps-old"
    logs.mkdir(parents=True)
    pipes.mkdir()
    assert leftover_pipes(logs) is None  # no record: none was started
    (logs / PIPES_RECORD).write_text(f"{pipes}\n")
    assert leftover_pipes(logs) is None  # recorded, but its socket is gone: it quit
    (pipes / "control").touch()
    assert leftover_pipes(logs) == pipes


def test_a_daemon_that_would_not_start_leaves_nothing_behind(tmp_path: Path) -> None:
    """A control binary that fails (here `false`, the shell's failing command) leaves the run time-sliced:
    no pipe folder, no record for a later launcher to quit."""
    daemon = MpsDaemon(tmp_path, "false")
    assert not daemon.start()
    assert not daemon.pipes.exists() and leftover_pipes(daemon.logs) is None
    daemon.stop()  # nothing to quit


@pytest.mark.gpu
def test_two_processes_run_as_clients_of_the_run_s_daemon(tmp_path: Path) -> None:
    """Started for a run, the daemon serves the processes given its environment, and quits at the end."""
    import torch

    control = find_control()
    if control is None or not torch.cuda.is_available():
        pytest.skip("needs a GPU and nvidia-cuda-mps-control")
    daemon = MpsDaemon(tmp_path, control)
    assert daemon.start()
    try:
        assert leftover_pipes(daemon.logs) == daemon.pipes  # what a launcher killed now would leave
        code = "import torch; x = torch.ones(256, 256, device='cuda'); print(float((x @ x).sum()))"
        env = {**os.environ, **daemon.env}
        for _ in range(2):
            done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
            assert done.returncode == 0 and float(done.stdout) == 256.0**3, done.stderr
    finally:
        daemon.stop()
    assert leftover_pipes(daemon.logs) is None
    logs = "".join(f.read_text() for f in sorted(daemon.logs.glob("*.log"))).lower()
    assert logs.count("new client") >= 2, logs  # both processes went through this daemon
