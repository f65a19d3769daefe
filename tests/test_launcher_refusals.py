"""`rlbus up` refuses what cannot work before it starts anything, and says the fix."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from e2e_utils import rlbus_up


def test_missing_wandb_is_refused_before_anything_starts(tmp_path: Path, nats_url: str, run_id: str) -> None:
    if importlib.util.find_spec("wandb") is not None:
        pytest.skip("wandb is installed here")
    done = rlbus_up(tmp_path, nats_url, run_id, "trainer.logger=['console','wandb']", timeout=60)
    assert done.returncode == 2, done.stderr
    assert "trainer.logger names wandb, which is not installed" in done.stderr
