"""Estimators and policy losses by import path, with verl's call signatures: docs/plugins.md's worked
example is the code under test (its Python blocks are written to a module here)."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch
from batch_utils import ready_group

from rlbus.config import load_config
from rlbus.config.loader import ConfigError
from rlbus.learner.algorithms.advantages import user_advantages
from rlbus.learner.batch import collate
from rlbus.learner.trainer import PolicyTrainer
from rlbus.plugins import load_callable
from rlbus.tiny_model import default_model_path

DOC = Path(__file__).resolve().parents[1] / "docs" / "plugins.md"


@pytest.fixture()
def example(tmp_path: Path) -> Path:
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    assert len(blocks) == 2
    module = tmp_path / "my_algos.py"
    module.write_text("\n\n".join(blocks))
    return module


def test_the_worked_estimator_gets_verls_arguments(example: Path) -> None:
    fn = load_callable(f"{example}:grpo_median", "algorithm.adv_estimator")
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 0, 0], [1, 1, 0]], dtype=torch.float32)
    token_rewards = torch.zeros(5, 3)
    token_rewards[torch.arange(5), mask.sum(-1).long() - 1] = rewards
    adv, ret = user_advantages(fn, token_rewards, mask, torch.tensor([7, 7, 7, 9, 9]), config=None)
    # group 7 median 0 -> 1, 0, 0; group 9 (0, 1): torch's median is the lower middle, 0 -> 0, 1
    want = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0]).unsqueeze(-1) * mask
    assert torch.equal(adv, want) and torch.equal(ret, want)


def test_a_training_step_runs_with_both_plugins(example: Path) -> None:
    torch.manual_seed(0)
    cfg = load_config(
        None,
        [
            "actor.optim.lr=1e-3",
            f"algorithm.adv_estimator={example}:grpo_median",
            f"actor_rollout_ref.actor.policy_loss={example}:clipped_pg",
        ],
    )
    trainer = PolicyTrainer(cfg, default_model_path(), torch.device("cpu"), total_steps=10)
    assert trainer.user_estimator.__name__ == "grpo_median"
    assert trainer.user_policy_loss.__name__ == "clipped_pg"
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    groups = [
        ready_group([3, 4, 5], [[6, 7], [8], [9, 10, 11]], [1.0, 0.0, 0.0]),
        ready_group([12, 13], [[14], [15, 16]], [0.0, 1.0]),
    ]
    metrics = trainer.train_step(collate(groups, pad_id=0))
    assert metrics["actor/ratio_mean"] == pytest.approx(1.0, abs=1e-5)  # on-policy: the loss's own metric
    assert all(np.isfinite(v) for v in metrics.values())
    assert any(not torch.equal(before[k], v) for k, v in trainer.model.state_dict().items())


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("algorithm.adv_estimator=no_such_module:fn", "adv_estimator"),
        ("algorithm.adv_estimator=grpo_typo", "adv_estimator"),
        ("actor.policy_loss=rlbus.plugins:no_such_fn", "policy_loss"),
    ],
)
def test_a_wrong_plugin_fails_at_load_naming_the_key(override: str, key: str) -> None:
    with pytest.raises(ConfigError, match=key):
        load_config(None, [override])
