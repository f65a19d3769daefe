"""`rlbus up` refuses what cannot work before it starts anything, and says the fix."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest


def test_missing_wandb_is_refused_before_anything_starts(tmp_path: Path, nats_url: str, run_id: str) -> None:
    if importlib.util.find_spec("wandb") is not None:
        pytest.skip("wandb is installed here")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "rlbus.cli",
            "up",
            f"bus.url={nats_url}",
            f"run.id={run_id}",
            f"run.dir={tmp_path / 'runs'}",
            "trainer.logger=['console','wandb']",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert done.returncode == 2, done.stderr
    assert "trainer.logger names wandb, which is not installed" in done.stderr
