"""`rlbus up` supervises its services: SIGKILL one mid-run (the learner too) and the run still finishes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest
from e2e_utils import FAST, running_services, up_command, wait_until

from rlbus.metrics_log import read_metrics

STEPS = 60


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_killed_services_are_restarted_and_the_run_finishes(
    tmp_path: Path, nats_url: str, run_id: str
) -> None:
    run_dir = tmp_path / "runs" / run_id
    up = subprocess.Popen(
        up_command(
            tmp_path,
            nats_url,
            run_id,
            *FAST,
            f"trainer.total_training_steps={STEPS}",
            "trainer.save_freq=10",
            "trainer.test_freq=-1",
            "trainer.val_before_train=false",
            "run.restart_backoff_s=0.5",
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
    )
    try:

        def step() -> int:
            rows = read_metrics(run_dir)
            return int(rows[-1]["step"]) if rows else 0

        wait_until(lambda: step() >= 5, 180, "step 5")
        os.kill(running_services(run_dir)["rollout-0"], signal.SIGKILL)
        wait_until(lambda: step() >= 15, 180, "step 15 after the replica kill")  # past the step-10 checkpoint
        learner = running_services(run_dir)["learner"]
        os.kill(learner, signal.SIGKILL)
        wait_until(
            lambda: running_services(run_dir).get("learner") not in (None, learner), 60, "a new learner"
        )
        out, err = up.communicate(timeout=300)
    finally:
        if up.poll() is None:
            up.send_signal(signal.SIGINT)
            up.communicate(timeout=60)
    assert up.returncode == 0, err[-3000:]
    assert "rollout-0 exited with -9; restarting it (1/5)" in err, err[-3000:]
    assert "learner exited with -9; restarting it (1/5), from its last checkpoint" in err, err[-3000:]
    assert f"step {STEPS}/{STEPS}" in out
    steps = [int(r["step"]) for r in read_metrics(run_dir) if "reward/mean" in r]
    assert steps == list(range(1, STEPS + 1)), steps  # the resumed learner rewound to step 10 and went on
    ledger = json.loads((run_dir / "ledger.json").read_text())
    assert len(ledger["trained"]) == STEPS * 16  # data.train_batch_size
    assert set(ledger["dispatched"]) == set(ledger["trained"]) | set(ledger["dropped"])
