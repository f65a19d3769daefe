"""A verl user's data and reward function: parquet in verl's schema, chat prompts, compute_score's signature."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest

from rlbus.config import ConfigError, load_config
from rlbus.learner.data import (
    DataError,
    check_scorers,
    load_split,
    prepare_prompts,
    record_to_item,
    task_for_source,
    truncate_prompt,
)
from rlbus.tiny_model import default_model_path

CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}={% endif %}"
)

COMPUTE_SCORE = """
import json, os

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    with open(os.environ["RLBUS_TEST_CALLS"], "a") as f:
        f.write(json.dumps([data_source, solution_str, ground_truth, extra_info]) + "\\n")
    return {"score": float(solution_str.strip().startswith(str(ground_truth))), "acc": None}
"""


def verl_rows(count: int, seed: int = 0) -> list[dict]:
    """GSM8K-schema rows as verl's examples/data_preprocess/gsm8k.py writes them (on our addition task)."""
    rng = random.Random(seed)
    rows = []
    for i in range(count):
        a, b = rng.randint(10, 49), rng.randint(10, 49)
        rows.append(
            {
                "data_source": "openai/gsm8k",
                "prompt": [{"role": "user", "content": f"{a}+{b}"}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": str(a + b)},
                "extra_info": {"split": "train", "index": i},
            }
        )
    return rows


def write_parquet(rows: list[dict], path: Path) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def chat_model(tmp_path: Path) -> Path:
    """The bundled tiny model with a chat template: 'content' then '=' as the generation prompt."""
    model = tmp_path / "chat-model"
    shutil.copytree(default_model_path(), model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config["chat_template"] = CHAT_TEMPLATE
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    return model


def test_single_path_and_files_imply_file_data(tmp_path: Path) -> None:
    cfg = load_config(None, [f"data.train_files={tmp_path}/train.parquet"])
    assert cfg.data.train_files == [tmp_path / "train.parquet"]
    assert cfg.data.task == "jsonl"  # the files are the data, never the synthetic default
    with pytest.raises(ConfigError, match="data.task=addition makes its own synthetic data"):
        load_config(None, [f"data.train_files={tmp_path}/t.parquet", "data.task=addition"])


def test_verl_row_carries_ground_truth_source_and_extra_info() -> None:
    cfg = load_config(None, ["data.train_files=/x.parquet"]).data
    prompt, meta = record_to_item(verl_rows(1)[0], cfg)
    assert prompt == [{"role": "user", "content": prompt[0]["content"]}]
    assert meta["data_source"] == "openai/gsm8k" and meta["task"] == "gsm8k"
    assert meta["ground_truth"] == meta["answer"] and meta["extra_info"] == {"split": "train", "index": 0}
    assert task_for_source("lighteval/MATH") == "math" and task_for_source("my/own") == "my/own"


def test_unknown_data_source_without_a_reward_function_is_refused() -> None:
    with pytest.raises(DataError, match="custom_reward_function.path"):
        check_scorers([("p", {"task": "my/own"})], "task")
    check_scorers([("p", {"task": "my/own"})], "function")


def test_truncation_modes_and_overlong_prompts(tmp_path: Path) -> None:
    ids = list(range(10))
    assert truncate_prompt(ids, 4, "left") == [6, 7, 8, 9]
    assert truncate_prompt(ids, 4, "right") == [0, 1, 2, 3]
    assert truncate_prompt(ids, 4, "middle") == [0, 1, 8, 9]
    with pytest.raises(DataError, match="data.truncation=error"):
        truncate_prompt(ids, 4, "error")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(chat_model(tmp_path)))
    path = write_parquet(verl_rows(6), tmp_path / "train.parquet")
    data = load_config(None, [f"data.train_files={path}", "data.max_prompt_length=5"]).data
    with pytest.raises(DataError, match="data.filter_overlong_prompts=true"):
        prepare_prompts(load_split(data, "train"), tok, data, "train")  # "12+34=" is 6 tokens
    kept = load_config(None, [f"data.train_files={path}", "data.max_prompt_length=6"]).data
    rendered = prepare_prompts(load_split(kept, "train"), tok, kept, "train")
    assert [p for p, _ in rendered] == [r["prompt"][0]["content"] + "=" for r in verl_rows(6)]


@pytest.mark.timeout(300)
def test_verl_parquet_trains_with_chat_prompts_and_compute_score(
    nats_url: str, run_id: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from e2e_utils import Run, make_config, rollout_groups

    train = write_parquet(verl_rows(64), tmp_path / "train.parquet")
    scorer = tmp_path / "my_reward.py"
    scorer.write_text(COMPUTE_SCORE)
    calls = tmp_path / "calls.jsonl"
    monkeypatch.setenv("RLBUS_TEST_CALLS", str(calls))
    cfg = make_config(
        nats_url,
        run_id,
        tmp_path,
        [
            f"actor_rollout_ref.model.path={chat_model(tmp_path)}",
            f"data.train_files={train}",
            f"custom_reward_function.path={scorer}",
            "custom_reward_function.name=compute_score",
            "data.train_batch_size=8",
            "rollout.n=4",
            "trainer.total_training_steps=2",
            "trainer.test_freq=-1",
            "trainer.val_before_train=false",
            f"trainer.rollout_data_dir={tmp_path / 'rollouts'}",
            "data.max_prompt_length=16",
        ],
    )
    with Run(cfg) as run:
        assert run.wait_learner(240) == 0, run.logs("learner") + run.logs("reward")
    groups = rollout_groups(tmp_path / "rollouts", 1)
    rows = {r["extra_info"]["index"]: r for r in verl_rows(64)}
    for group in groups:
        for sample in group:
            row = rows[sample["extra_info"]["index"]]
            assert sample["input"] == row["prompt"][0]["content"] + "="  # chat-rendered, not the list's repr
            assert (sample["data_source"], sample["gts"]) == (
                row["data_source"],
                row["reward_model"]["ground_truth"],
            )
            assert sample["reward_impl"].endswith("my_reward.py:compute_score")
            assert sample["score"] == float(
                sample["output"].strip().startswith(row["reward_model"]["ground_truth"])
            )
    seen = [json.loads(line) for line in calls.read_text().splitlines()]
    probes = [call for call in seen if call[3].get("rlbus_probe")]  # the reward service's start-up check
    assert len(probes) == 1, probes
    seen = [call for call in seen if call not in probes]
    assert seen, "compute_score was never called"
    for data_source, solution_str, ground_truth, extra_info in seen:
        row = rows[extra_info["index"]]
        assert (data_source, ground_truth, extra_info) == (
            row["data_source"],
            row["reward_model"]["ground_truth"],
            row["extra_info"],
        )
        assert isinstance(solution_str, str)
    assert groups and all(len(g) == 4 for g in groups)
