"""The README's "Coming from verl" section runs as written: its rlbus command is taken from the README and
run by bash unchanged, with HOME holding verl-schema parquet at ~/data/gsm8k and a Hugging Face cache
holding a stand-in for Qwen/Qwen2.5-0.5B-Instruct (the bundled tiny model with a chat template; nothing is
downloaded here). The set-up lines (`hf download`, verl's preprocessing script) are the user's to run. With
the model absent from the cache, the command stops with the error the README shows."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from test_verl_data import chat_model, verl_rows, write_parquet

from rlbus.metrics_log import read_metrics

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
HUB_ID = "Qwen/Qwen2.5-0.5B-Instruct"
SET_UP = ("hf download", "python3 examples/data_preprocess/gsm8k.py")


def section_commands() -> tuple[list[str], list[str]]:
    """(the rlbus commands, the set-up lines) of the section's first bash block, continuations joined."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Coming from verl") :]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    assert block is not None
    lines = block.group(1).replace("\\\n", " ").splitlines()
    set_up = [ln for ln in lines if ln.startswith(SET_UP)]
    commands = [ln for ln in lines if ln.strip() and not ln.startswith(SET_UP)]
    return commands, set_up


def fake_hub_cache(cache: Path, model: Path) -> None:
    """A huggingface_hub cache in which HUB_ID resolves to `model` (refs/main -> a snapshot)."""
    repo = cache / f"models--{HUB_ID.replace('/', '--')}"
    revision = "0" * 40
    shutil.copytree(model, repo / "snapshots" / revision)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(revision)


@pytest.mark.timeout(600)
def test_the_coming_from_verl_commands_run_as_written(nats_url: str, run_id: str, tmp_path: Path) -> None:
    commands, set_up = section_commands()
    assert len(set_up) == 2 and len(commands) == 1
    assert "python3 -m rlbus.main_ppo" in commands[0] and HUB_ID in commands[0]
    home = tmp_path / "home"
    data = home / "data" / "gsm8k"
    data.mkdir(parents=True)
    write_parquet(verl_rows(512), data / "train.parquet")  # 2 steps of 256 prompts an epoch
    write_parquet(verl_rows(16, seed=1), data / "test.parquet")
    model = chat_model(tmp_path)
    config = json.loads((model / "config.json").read_text())
    config["max_position_embeddings"] = 1024  # the command's 512 + 512 tokens (rotary positions)
    (model / "config.json").write_text(json.dumps(config))
    env = {
        **os.environ,
        "HOME": str(home),
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",  # python3: the one rlbus is in
        "HF_HUB_OFFLINE": "1",
        "RLBUS_BUS__URL": nats_url,
        "RLBUS_RUN__ID": run_id,
        "RLBUS_RUN__DIR": str(tmp_path / "runs"),
        "RLBUS_TRAINER__TOTAL_TRAINING_STEPS": "2",
    }

    def run_as_written(hf_cache: Path, timeout: float) -> subprocess.CompletedProcess[str]:
        """The README's command by bash (pipefail: its exit code, not tee's) with this HF cache."""
        return subprocess.run(
            ["bash", "-o", "pipefail", "-c", commands[0]],
            cwd=tmp_path,
            env={**env, "HF_HUB_CACHE": str(hf_cache)},
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    absent = run_as_written(tmp_path / "empty-cache", timeout=120)
    shown = f"rlbus: refused: model.path: hub id '{HUB_ID}' is not in the local Hugging Face cache"
    assert shown in (tmp_path / "verl_demo.log").read_text()  # the command tees its output there
    assert shown in (ROOT / "README.md").read_text()
    assert absent.returncode == 2  # refused at the pre-flight

    fake_hub_cache(tmp_path / "hf-cache", model)
    done = run_as_written(tmp_path / "hf-cache", timeout=540)
    log = (tmp_path / "verl_demo.log").read_text()
    assert done.returncode == 0, log[-4000:]
    rows = [r for r in read_metrics(tmp_path / "runs" / run_id) if "actor/pg_loss" in r]
    assert [r["step"] for r in rows] == [1, 2]
    assert all("critic/vf_loss" in r and "critic/score/mean" in r for r in rows)  # PPO with its critic
