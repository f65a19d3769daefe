"""verl's GSM8K quickstart, verbatim but for the module name and the data and model paths (local files, as
nothing is downloaded here), through `python3 -m rlbus.main_ppo`: it takes verl's defaults for what the
command leaves unset (PPO with a critic, one sample at temperature 1.0, on-policy) and logs verl's metric
names beside ours. The test's NATS, run id and dir, and a 2-step limit come from RLBUS_* variables."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from test_verl_data import chat_model, verl_rows, write_parquet
from test_verl_recipes import QUICKSTART

from rlbus.metrics_log import read_metrics

pytestmark = pytest.mark.slow

VERL_METRICS = (
    "critic/score/mean",
    "response_length/mean",
    "actor/ppo_kl",
    "actor/pg_loss",
    "perf/throughput",
    "perf/cpu_memory_used_gb",
)


def quickstart_argv(train: Path, val: Path, model: Path) -> list[str]:
    """The quickstart's overrides as verl's docs give them, with our module and local paths."""
    command = QUICKSTART.split("2>&1")[0].replace("\\\n", " ")
    command = command.replace("$HOME/data/gsm8k/train.parquet", str(train))
    command = command.replace("$HOME/data/gsm8k/test.parquet", str(val))
    command = command.replace("Qwen/Qwen2.5-0.5B-Instruct", str(model))
    words = shlex.split(command)
    assert words[:4] == ["PYTHONUNBUFFERED=1", "python3", "-m", "verl.trainer.main_ppo"]
    return [sys.executable, "-m", "rlbus.main_ppo", *words[4:]]


@pytest.mark.timeout(600)
def test_verls_quickstart_runs_through_main_ppo_with_verls_defaults_and_names(
    nats_url: str, run_id: str, tmp_path: Path
) -> None:
    train = write_parquet(verl_rows(512), tmp_path / "train.parquet")  # 2 steps of 256 prompts an epoch
    val = write_parquet(verl_rows(16, seed=1), tmp_path / "test.parquet")
    model = chat_model(tmp_path)
    config = json.loads((model / "config.json").read_text())
    config["max_position_embeddings"] = 1024  # the quickstart's 512 + 512 tokens (rotary positions)
    (model / "config.json").write_text(json.dumps(config))
    env = {
        **os.environ,
        "RLBUS_BUS__URL": nats_url,
        "RLBUS_RUN__ID": run_id,
        "RLBUS_RUN__DIR": str(tmp_path / "runs"),
        "RLBUS_TRAINER__TOTAL_TRAINING_STEPS": "2",
        "PYTHONUNBUFFERED": "1",
    }
    done = subprocess.run(
        quickstart_argv(train, val, model), env=env, cwd=tmp_path, capture_output=True, text=True, timeout=540
    )
    assert done.returncode == 0, done.stderr[-4000:]
    run_dir = tmp_path / "runs" / run_id
    resolved = (run_dir / "config.yaml").read_text()
    assert "adv_estimator: gae" in resolved  # verl's default: PPO with the critic the command configures
    rows = [r for r in read_metrics(run_dir) if "actor/pg_loss" in r]
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        for name in VERL_METRICS:
            assert name in row, name
        assert row["critic/score/mean"] == row["reward/mean"]
        assert "critic/vf_loss" in row  # the critic trained
    assert "defaults that differ from verl's" not in done.stderr  # it took verl's: nothing to report
