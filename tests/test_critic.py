"""The PPO critic: value alignment with log-prob positions, a value update that learns, the GAE wiring."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from batch_utils import ready_group
from transformers import AutoModelForCausalLM

from rlbus.config import load_config
from rlbus.learner.algorithms.advantages import gae_advantages, sequence_to_token_rewards
from rlbus.learner.batch import collate
from rlbus.learner.critic import Critic, explained_variance
from rlbus.learner.trainer import PolicyTrainer
from rlbus.tiny_model import default_model_path


def _batch():
    groups = [
        ready_group([3, 4, 5], [[6, 7], [8], [9, 10, 11]], [1.0, 0.0, 0.0]),
        ready_group([12, 13], [[14], [15, 16]], [0.0, 1.0]),
    ]
    return collate(groups, pad_id=0)


def _critic(overrides: list[str] | None = None) -> Critic:
    torch.manual_seed(0)
    cfg = load_config(None, ["algorithm.adv_estimator=gae", *(overrides or [])])
    return Critic(cfg, default_model_path(), torch.device("cpu"), total_steps=10)


def test_backbone_is_the_policys_decoder_and_head_starts_at_zero() -> None:
    critic = _critic()
    policy = AutoModelForCausalLM.from_pretrained(default_model_path(), dtype=torch.float32)
    backbone = critic.model.backbone.state_dict()
    for name, param in policy.model.state_dict().items():
        assert torch.equal(backbone[name], param), name
    batch = _batch()
    values = critic.values(batch)
    assert values.shape == batch.response_mask.shape
    assert torch.count_nonzero(values) == 0  # zero-init head: V = 0 before any update


def test_values_align_with_logprob_positions() -> None:
    """values[b, t] is the head on the hidden state at position t: the state *before* token t+1."""
    critic = _critic()
    with torch.no_grad():
        critic.model.value_head.weight.normal_()
        critic.model.value_head.bias.fill_(0.1)
    batch = _batch()
    values = critic.values(batch)
    mask = batch.response_mask
    with torch.no_grad():
        for b in range(batch.size):
            n = int(batch.attention_mask[b].sum())
            ids = batch.input_ids[b : b + 1, :n]  # unpadded, one row: nothing else can leak in
            hidden = critic.model.backbone(input_ids=ids).last_hidden_state[0]
            expected = critic.model.value_head(hidden).squeeze(-1)
            for t in range(mask.shape[1]):
                if mask[b, t]:
                    assert values[b, t] == pytest.approx(float(expected[t]), abs=1e-5), (b, t)
                else:
                    assert values[b, t] == 0.0
    # the first response position is the last prompt token (len(prompt) - 1), like the log-prob mask
    assert mask[0].nonzero()[0].item() == 2 and mask[3].nonzero()[0].item() == 1


def test_update_reduces_value_loss_on_a_fixed_batch() -> None:
    critic = _critic(["critic.optim.lr=1e-3", "critic.cliprange_value=100.0"])
    batch = _batch()
    token_rewards = sequence_to_token_rewards(batch.rewards, batch.response_mask)
    first = None
    for _ in range(12):
        old = critic.values(batch)
        _, returns = gae_advantages(token_rewards, old, batch.response_mask, gamma=1.0, lam=1.0)
        metrics = critic.update(batch, returns, old)
        assert all(np.isfinite(v) for v in metrics.values()), metrics
        first = metrics if first is None else first
    assert first["critic/vf_loss"] > 0
    assert metrics["critic/vf_loss"] < 0.5 * first["critic/vf_loss"], (first, metrics)
    assert metrics["critic/explained_variance"] > first["critic/explained_variance"]
    assert set(metrics) >= {
        "critic/vf_loss",
        "critic/vf_clipfrac",
        "critic/values_mean",
        "critic/explained_variance",
    }


def test_value_clip_bounds_the_step() -> None:
    critic = _critic(["critic.optim.lr=1e-2", "critic.cliprange_value=0.01"])
    batch = _batch()
    old = critic.values(batch)
    returns = torch.full_like(old, 5.0) * batch.response_mask
    critic.update(batch, returns, old)
    metrics = critic.update(batch, returns, old)  # values moved past old + 0.01: the clip is active
    assert metrics["critic/vf_clipfrac"] > 0.5


def test_explained_variance() -> None:
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    returns = torch.tensor([[1.0, 2.0, 9.0], [3.0, 4.0, 5.0]])
    assert explained_variance(returns, returns, mask) == pytest.approx(1.0)
    assert explained_variance(torch.full_like(returns, 3.0), returns, mask) == pytest.approx(0.0, abs=1e-6)
    assert explained_variance(-returns, returns, mask) < 0.0
    assert explained_variance(returns, torch.ones_like(returns), mask) == 0.0  # constant returns: no signal


def test_ppo_gae_train_step_updates_policy_and_critic() -> None:
    torch.manual_seed(0)
    cfg = load_config(
        None,
        [
            "algorithm.adv_estimator=gae",
            "actor.optim.lr=1e-3",
            "critic.optim.lr=1e-3",
            "actor.ppo_mini_batch_size=1",
            "actor.ppo_micro_batch_size=2",
        ],
    )
    trainer = PolicyTrainer(cfg, default_model_path(), torch.device("cpu"), total_steps=10)
    assert trainer.critic is not None
    policy_before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    head_before = trainer.critic.model.value_head.weight.clone()
    batch = _batch()
    metrics = trainer.train_step(batch)
    assert all(np.isfinite(v) for v in metrics.values()), metrics
    assert any(not torch.equal(policy_before[k], v) for k, v in trainer.model.state_dict().items())
    assert not torch.equal(head_before, trainer.critic.model.value_head.weight)
    assert metrics["critic/values_mean"] == 0.0  # the advantages used the zero-init critic's values
    assert metrics["critic/vf_loss"] > 0
    assert trainer.critic.values(batch).abs().sum() > 0
    # critic-free estimators build no critic
    grpo = PolicyTrainer(load_config(None, []), default_model_path(), torch.device("cpu"), total_steps=10)
    assert grpo.critic is None


def test_overlong_penalty_shapes_rewards_before_advantages() -> None:
    from rlbus.learner.trainer import shaped_rewards

    cfg = load_config(
        None,
        [
            "data.max_response_length=3",
            "algorithm.overlong_buffer_len=2",
            "algorithm.overlong_penalty_factor=1.0",
        ],
    )
    batch = _batch()  # response lengths 2, 1, 3, 1, 2
    rewards, metrics = shaped_rewards(cfg, batch)
    assert rewards.tolist() == pytest.approx([1.0 - 0.5, 0.0, 0.0 - 1.0, 0.0, 1.0 - 0.5])
    assert metrics["dapo/overlong_frac"] == pytest.approx(3 / 5)
    off, none = shaped_rewards(load_config(None, []), batch)
    assert torch.equal(off, batch.rewards) and none == {}


def test_ppo_gae_with_kl_in_reward() -> None:
    """KL in the reward: token rewards get -kl_coef * KL(old || ref) on every token before GAE."""
    torch.manual_seed(0)
    cfg = load_config(
        None,
        [
            "algorithm.adv_estimator=gae",
            "algorithm.use_kl_in_reward=true",
            "algorithm.kl_ctrl.kl_coef=0.1",
            "actor.optim.lr=1e-3",
        ],
    )
    trainer = PolicyTrainer(cfg, default_model_path(), torch.device("cpu"), total_steps=10)
    groups = [
        ready_group([3, 4, 5], [[6, 7], [8], [9, 10, 11]], [1.0, 0.0, 0.0]),
        ready_group([12, 13], [[14], [15, 16]], [0.0, 1.0]),
    ]
    for g in groups:  # a reference that disagrees with the policy: a non-zero KL on every token
        g.ref_logprobs = [
            np.full(len(s.response_ids), -50.0, dtype=np.float32) for s in g.scored.trajectories.samples
        ]
    batch = collate(groups, pad_id=0)
    metrics = trainer.train_step(batch)
    assert all(np.isfinite(v) for v in metrics.values()), metrics
    # k1 = log p_old - log p_ref > 45 on every token, times 0.1: a penalty that outweighs any reward <= 1
    assert metrics["critic/returns_mean"] < -1.0
