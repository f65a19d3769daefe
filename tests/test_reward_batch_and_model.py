"""verl's batch reward manager and a reward-model scorer: one call scores a whole fetch of groups."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

from rlbus.config import load_config
from rlbus.messages import PromptWork, Sample, SamplingParams, TrajectoryGroup
from rlbus.reward.scorers import FunctionScorer, RewardModelScorer, build_scorer
from rlbus.reward.service import score_groups

TESTS = str(Path(__file__).parent)


@pytest.fixture(autouse=True)
def _tests_importable(monkeypatch) -> None:
    monkeypatch.syspath_prepend(TESTS)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([TESTS, os.environ.get("PYTHONPATH", "")]))


def _group(index: int, texts: list[str], data_source: str, truth: str) -> TrajectoryGroup:
    work = PromptWork(
        run_id="r",
        prompt_id=f"p{index}",
        index=index,
        step=0,
        min_policy_version=0,
        prompt_ids=[1],
        prompt_text=f"question {index}? ",
        meta={"data_source": data_source, "ground_truth": truth, "extra_info": {"index": index}},
        n=len(texts),
        sampling=SamplingParams(),
    )
    samples = [Sample(response_ids=[1], logprobs=np.zeros(1, np.float32), text=t) for t in texts]
    return TrajectoryGroup(work=work, samples=samples, policy_version=0, replica_id="x", engine="hf")


def test_verl_batch_manager_scores_every_group_of_a_fetch_in_one_call() -> None:
    cfg = load_config(
        None,
        [
            f"custom_reward_function.path={TESTS}/reward_fns.py",
            "custom_reward_function.name=batch_compute_score",
            "reward_model.reward_manager=batch",
        ],
    )
    assert cfg.reward.type == "function" and cfg.reward.manager == "batch"
    scorer = build_scorer(cfg.reward)
    try:
        assert scorer.batched and scorer.verl
        groups = [
            _group(0, ["42", " 7 "], "openai/gsm8k", "42"),
            _group(1, ["7"], "openai/gsm8k", "7"),
            _group(2, ["x"], "other", "x"),
        ]
        scored = score_groups(scorer, groups, on_error=-9.0)
        assert [s.rewards for s in scored] == [[1.0, 0.0], [1.0], [-1.0]]
        assert [s.correct for s in scored] == [[True, False], [True], [False]]
        assert all(e is None for s in scored for e in s.reward_errors)
    finally:
        scorer.close()


def test_a_batch_function_with_the_wrong_count_marks_the_call_not_the_service() -> None:
    scorer = FunctionScorer(f"{TESTS}/reward_fns.py:batch_wrong_length", 10, 512, "verl", "batch")
    try:
        scored = score_groups(scorer, [_group(0, ["a", "b"], "openai/gsm8k", "a")], on_error=-0.5)
        assert scored[0].rewards == [-0.5, -0.5]
        assert "not 2 scores" in scored[0].reward_errors[0]
    finally:
        scorer.close()


def _reward_model(tmp_path: Path) -> Path:
    from transformers import Qwen2ForSequenceClassification

    from rlbus.tiny_model import build_tokenizer, make_config

    tok = build_tokenizer(tmp_path / "rm")
    config = make_config(tok, num_labels=1, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    Qwen2ForSequenceClassification(config).save_pretrained(str(tmp_path / "rm"))
    return tmp_path / "rm"


def test_reward_model_scores_batched_as_one_at_a_time(tmp_path: Path) -> None:
    path = _reward_model(tmp_path)
    cfg = load_config(
        None,
        [
            "reward_model.enable=True",
            f"reward_model.model.path={path}",
            "reward_model.micro_batch_size_per_gpu=3",
        ],
    )
    assert cfg.reward.type == "model" and cfg.reward_model.micro_batch_size == 3
    scorer = build_scorer(cfg.reward, cfg.reward_model)
    assert isinstance(scorer, RewardModelScorer) and scorer.batched
    groups = [_group(i, ["12", "a much longer answer " * (i + 1), "7"], "any", "") for i in range(3)]
    scored = score_groups(scorer, groups, on_error=-9.0)
    got = [r for s in scored for r in s.rewards]
    assert len(set(got)) > 1 and all(e is None for s in scored for e in s.reward_errors)
    for s in scored:  # each alone, unpadded: padding and micro-batching change nothing
        for text, reward in zip([x.text for x in s.trajectories.samples], s.rewards, strict=True):
            ids = scorer.tokenizer(s.trajectories.work.prompt_text + text, add_special_tokens=False)
            with torch.no_grad():
                alone = float(scorer.model(input_ids=torch.tensor([ids["input_ids"]])).logits[0, 0])
            assert reward == pytest.approx(alone, abs=1e-5)


def test_reward_model_keys_fail_clearly(tmp_path: Path) -> None:
    from rlbus.config.loader import ConfigError

    with pytest.raises(ConfigError, match="reward_model.model.path"):
        load_config(None, ["reward_model.enable=True"])
    cfg = load_config(None, ["reward_model.enable=True", f"reward_model.model.path={tmp_path}"])
    with pytest.raises(ValueError, match="reward model cannot load"):
        build_scorer(cfg.reward, cfg.reward_model)


def test_reward_model_keys_without_enable_are_warned() -> None:
    from rlbus.config.warnings import inert_key_warnings

    cfg = load_config(None, ["reward_model.model.path=/somewhere", "reward_model.reward_manager=batch"])
    warned = "\n".join(inert_key_warnings(cfg))
    assert "reward_model.model_path" in warned and "reward_model.enable=true" in warned
    assert "reward.manager=batch has no effect with reward.type=task" in warned
