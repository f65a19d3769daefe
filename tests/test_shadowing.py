"""A folder named rlbus/ where the user stands (a clone, a data folder) must not hide the installed package:
`python -m rlbus.cli` and `python -m rlbus.main_ppo` say so and stop (python puts the working directory
first on sys.path), and the services `rlbus up` starts from there run (PYTHONSAFEPATH)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from e2e_utils import up_command


@pytest.mark.parametrize("module", ["rlbus.cli", "rlbus.main_ppo"])
def test_python_m_from_beside_a_folder_named_rlbus_says_what_hides_the_package(
    tmp_path: Path, module: str
) -> None:
    (tmp_path / "rlbus").mkdir()
    done = subprocess.run(
        [sys.executable, "-m", module, "--version"], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2
    assert f"the folder {tmp_path / 'rlbus'} hides the installed rlbus package" in done.stderr


@pytest.mark.timeout(180)
def test_rlbus_up_beside_a_folder_named_rlbus_runs(tmp_path: Path, nats_url: str, run_id: str) -> None:
    (tmp_path / "rlbus").mkdir()
    command = up_command(
        tmp_path, nats_url, run_id, "trainer.total_training_steps=2", "run.service_start=exec"
    )
    rlbus = Path(sys.executable).with_name("rlbus")  # the installed command, as a user types it
    done = subprocess.run(
        [str(rlbus), *command[3:]], cwd=tmp_path, capture_output=True, text=True, timeout=170
    )
    assert done.returncode == 0, done.stderr[-3000:]
