"""The trajectory log (bus.trajectory_log) and `rlbus replay`: every trained group is kept in a retained
stream with its step, and the export writes each trained prompt's samples once, in the step the ledger
records, leaving out the groups of a learner attempt that died (the ledger never counted them)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from e2e_utils import running_services, up_command, wait_until

from rlbus.learner.dispatch import Ledger
from rlbus.messages import PromptWork, ReadyGroup, Sample, SamplingParams, ScoredGroup, TrajectoryGroup
from rlbus.metrics_log import read_metrics
from rlbus.replay import export_rows


def _group(pid: str, index: int, n: int = 2) -> ReadyGroup:
    work = PromptWork(
        run_id="r",
        prompt_id=pid,
        index=index,
        step=0,
        min_policy_version=0,
        prompt_ids=[1, 2],
        n=n,
        sampling=SamplingParams(),
        meta={"answer": "3"},
    )
    samples = [Sample(response_ids=[5, 6], logprobs=[-1.0, -2.0], text=str(k)) for k in range(n)]
    traj = TrajectoryGroup(work=work, samples=samples, policy_version=0, replica_id="x", engine="hf")
    return ReadyGroup(scored=ScoredGroup(trajectories=traj, rewards=[0.0] * n, correct=[False] * n))


def test_the_export_keeps_what_the_ledger_trained_once_in_its_step() -> None:
    ledger = Ledger()
    ledger.dispatched.update({"p0": 0, "p1": 1, "p2": 2, "a1-p2": 2})
    ledger.trained.update({"p0": 0, "p1": 0, "a1-p2": 1})  # step index 0-based, as the learner keeps it
    ledger.dropped["p2"] = "resumed"
    logged = [
        (1, _group("p1", 1)),
        (1, _group("p0", 0)),
        (2, _group("p2", 2)),  # trained by an attempt that died before its checkpoint: not counted
        (2, _group("a1-p2", 2)),
        (2, _group("a1-p2", 2)),  # stored twice would still export once
    ]
    rows = export_rows(logged, ledger)
    assert sorted(rows) == [1, 2]
    assert [r["uid"] for r in rows[1]] == ["p0", "p0", "p1", "p1"]  # data order, every sample
    assert [r["uid"] for r in rows[2]] == ["a1-p2", "a1-p2"]
    assert all(r["step"] == step for step, rs in rows.items() for r in rs)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_run_with_a_learner_restart_replays_every_trained_sample_once(run_id: str, tmp_path: Path) -> None:
    steps, batch, n = 8, 8, 4
    run_dir = tmp_path / "runs" / run_id
    up = subprocess.Popen(
        up_command(
            tmp_path,
            None,
            run_id,
            f"trainer.total_training_steps={steps}",
            f"data.train_batch_size={batch}",
            f"rollout.n={n}",
            "trainer.val_before_train=false",
            "trainer.test_freq=0",
            "bus.trajectory_log=true",
        ),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
    )
    try:
        wait_until(
            lambda: (run_dir / "metrics.jsonl").exists() and len(read_metrics(run_dir)) >= 3, 200, "step 3"
        )
        os.kill(running_services(run_dir)["learner"], signal.SIGKILL)
        _, err = up.communicate(timeout=300)
    finally:
        if up.poll() is None:
            up.kill()
    assert up.returncode == 0, err[-3000:]
    assert "restarting it" in err, "the learner was not killed: this test checked no restart"
    t0 = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "rlbus.cli", "replay", str(run_dir), "--out", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    ledger = json.loads((run_dir / "ledger.json").read_text())
    rows = [
        r for path in sorted((tmp_path / "out").glob("*.parquet")) for r in pq.read_table(path).to_pylist()
    ]
    by_uid: dict[str, list[dict]] = {}
    for r in rows:
        by_uid.setdefault(r["uid"], []).append(r)
    assert set(by_uid) == set(ledger["trained"]), "the export and the ledger disagree on what was trained"
    assert len(ledger["trained"]) == steps * batch
    for uid, samples in by_uid.items():
        assert len(samples) == n, uid
        assert {s["step"] for s in samples} == {ledger["trained"][uid] + 1}, uid
    print(f"replayed {len(rows)} samples of {len(by_uid)} prompts in {time.monotonic() - t0:.1f} s")
