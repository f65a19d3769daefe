"""`rlbus up` refuses what cannot work before it starts anything, and says the fix."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from e2e_utils import rlbus_up


def test_missing_wandb_is_refused_before_anything_starts(tmp_path: Path, nats_url: str, run_id: str) -> None:
    if importlib.util.find_spec("wandb") is not None:
        pytest.skip("wandb is installed here")
    done = rlbus_up(tmp_path, nats_url, run_id, "trainer.logger=['console','wandb']", timeout=60)
    assert done.returncode == 2, done.stderr
    assert "trainer.logger names wandb, which is not installed" in done.stderr


def test_a_refused_reward_function_has_its_reason_on_the_console(
    tmp_path: Path, nats_url: str, run_id: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reward service refuses a function that cannot take the call (exit 2): `rlbus up` stops, and its
    last line says why, not only which log to open."""
    tests_dir = str(Path(__file__).parent)
    monkeypatch.setenv("PYTHONPATH", tests_dir + ":" + os.environ.get("PYTHONPATH", ""))
    t0 = time.monotonic()
    done = rlbus_up(
        tmp_path,
        nats_url,
        run_id,
        "reward.type=function",
        "reward.function=reward_fns:two_arguments",
        timeout=120,
    )
    took = time.monotonic() - t0
    assert done.returncode == 2, done.stderr
    assert took < 15, f"the refusal took {took:.1f} s (issue 29: within 15 s)"
    last = done.stderr.strip().splitlines()[-1]
    assert (
        "reward refused its configuration: " in last
        and "cannot be called as fn(prompt, response, meta)" in last
    )


def test_mps_asked_for_without_its_control_binary_is_refused(
    tmp_path: Path, nats_url: str, run_id: str
) -> None:
    from rlbus.gpu_sharing import find_control

    if find_control() is not None:
        pytest.skip("nvidia-cuda-mps-control is installed here")
    done = rlbus_up(tmp_path, nats_url, run_id, "run.gpu_sharing=mps", timeout=60)
    assert done.returncode == 2, done.stderr
    assert "run.gpu_sharing=mps, but nvidia-cuda-mps-control is not installed" in done.stderr


def test_the_launcher_imports_no_torch_where_no_gpu_driver_is_installed() -> None:
    """Counting GPUs where no driver is installed needs no torch: its import (3-8 s of CPU on the 2-core box)
    would compete with the preloading server's, which every service, and so a refusal at start, waits for."""
    from rlbus.launcher import gpu_driver_installed

    if gpu_driver_installed():
        pytest.skip("a GPU driver is installed here")
    code = (
        "import sys\n"
        "from rlbus.config import load_config\n"
        "from rlbus.launcher import start_problems, visible_gpus\n"
        "gpus = visible_gpus()\n"
        "start_problems(load_config(None, []), gpus)\n"
        "print(gpus, 'torch' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["0", "False"]
