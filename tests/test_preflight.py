"""Start-up failures reach the console (rlbus.preflight, rlbus.log_reasons): a missing model directory, an
uncached hub id, a missing or mis-schema'd data file, chat prompts on a tokenizer without a chat template,
a package the config asks for but that is not installed stop `rlbus up` and `rlbus check` at once with exit
2 and the key named, before any service starts; a service that refused or kept dying has its reason on the
console's last line, not only in its log."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlbus.log_reasons import first_error


def _rlbus(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rlbus.cli", *args],
        cwd=cwd,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=15,  # the acceptance bound: refused within 15 s, not after five restarts
    )


@pytest.fixture
def bad_parquet(tmp_path: Path) -> Path:
    path = tmp_path / "train.parquet"
    pq.write_table(pa.table({"question": ["1+1?"], "answer": ["2"]}), path)
    return path


CASES = {
    "missing model dir": (["model.path=/models/Qwen2.5-0.5B-Instruct"], "model.path", "does not exist"),
    "uncached hub id": (
        ["model.path=Qwen/Qwen2.5-0.5B-Instruct"],
        "model.path",
        "not in the local Hugging Face cache",
    ),
    "missing data file": (
        ["data.train_files=/data/gsm8k/train.parquet"],
        "data.train_files",
        "does not exist",
    ),
    "no prompt column": (["data.train_files={bad_parquet}"], "data.train_files", "no column 'prompt'"),
    "dir without config.json": (["model.path={tmp}"], "model.path", "no config.json"),
    "chat prompts, no template": (["data.train_files={chat_parquet}"], "model.path", "has no chat template"),
    "liger not installed": (["model.use_liger=true"], "model.use_liger", "needs the liger_kernel package"),
    "unloadable reward": (
        ["reward.type=function", "reward.function=nonexistent_mod:fn"],
        "reward.function",
        "no module 'nonexistent_mod'",
    ),
    "reward file missing": (
        ["custom_reward_function.path=/nope/my_reward.py"],
        "custom_reward_function.path",
        "/nope/my_reward.py does not exist",
    ),
}


@pytest.fixture
def chat_parquet(tmp_path: Path) -> Path:
    """verl's schema: the prompt is a list of chat messages (the bundled tiny tokenizer has no template)."""
    path = tmp_path / "chat.parquet"
    rows = [{"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": "1+1"}], "answer": "2"}]
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


@pytest.mark.parametrize("command", ["up", "check"])
@pytest.mark.parametrize("case", list(CASES))
def test_a_start_up_failure_is_refused_at_once_with_its_key(
    case: str, command: str, tmp_path: Path, bad_parquet: Path, chat_parquet: Path
) -> None:
    overrides, key, reason = CASES[case]
    if case == "liger not installed" and importlib.util.find_spec("liger_kernel") is not None:
        pytest.skip("liger-kernel is installed here")
    overrides = [
        o.format(bad_parquet=bad_parquet, chat_parquet=chat_parquet, tmp=tmp_path) for o in overrides
    ]
    hf_cache = {"HF_HUB_CACHE": str(tmp_path / "empty-hf-cache"), "HF_HUB_OFFLINE": "1"}
    out = _rlbus(command, f"run.dir={tmp_path / 'runs'}", *overrides, cwd=tmp_path, env=hf_cache)
    assert out.returncode == 2, out.stderr
    assert f"refused: {key}: " in out.stderr and reason in out.stderr
    assert not (tmp_path / "runs").exists()  # nothing started: no run dir, no logs to go and read


def test_check_passes_the_default_run(tmp_path: Path) -> None:
    out = _rlbus("check", f"run.dir={tmp_path}", cwd=tmp_path)
    assert out.returncode == 0 and "can start" in out.stdout


def test_the_first_error_of_a_log_is_found(tmp_path: Path) -> None:
    log = tmp_path / "reward.log"
    log.write_text(
        "\n".join(
            [
                json.dumps({"event": "service started", "level": "info"}),
                json.dumps(
                    {"event": "reward function refused", "level": "error", "error": "takes 2 arguments"}
                ),
                json.dumps({"event": "stopped", "level": "info"}),
            ]
        )
    )
    assert first_error(log) == "reward function refused: takes 2 arguments"
    crash = tmp_path / "rollout.log"
    crash.write_text(
        'Traceback (most recent call last):\n  File "x.py", line 1, in <module>\n'
        "OSError: Incorrect path_or_model_id: '/models/x'. Please provide either the path\n"
    )
    assert first_error(crash).startswith("OSError: Incorrect path_or_model_id: '/models/x'")
    console = tmp_path / "learner.log"  # structlog's console renderer, as `rlbus up` writes the logs
    console.write_text(
        "05:09:23 [info     ] service started                bus=nats://127.0.0.1:4222\n"
        '05:09:23 [error    ] model cannot load reason="/models/x: no config.json" service=learner-0\n'
        "05:09:23 [info     ] service stopped                rc=2 service=learner-0\n"
    )
    assert first_error(console) == "model cannot load: /models/x: no config.json"
    assert first_error(tmp_path / "absent.log") == ""
    restarted = tmp_path / "learner-restarted.log"  # an earlier start's error, then the cause and its echo
    restarted.write_text(
        "06:00:00 [info     ] service started                service=learner-0\n"
        '06:00:01 [error    ] batch failed                   error="old trouble" service=learner-0\n'
        "06:00:05 [info     ] service started                service=learner-0\n"
        '06:00:06 [error    ] checkpoint cannot load         error="step_4: no meta.json" service=learner-0\n'
        '06:00:06 [error    ] service failed                 error="CheckpointError" service=learner-0\n'
    )
    assert first_error(restarted) == "checkpoint cannot load: step_4: no meta.json"
