"""verl's algorithm conventions on hand-computed cases: GRPO's all-equal groups, vanilla's dual clip, GSPO's
aggregation, and the start-up warnings for keys that mean nothing in the resolved config."""

from __future__ import annotations

import math

import pytest
import torch

from rlbus.config import ConfigError, load_config
from rlbus.config.warnings import inert_key_warnings
from rlbus.learner.algorithms.advantages import grpo_advantages, rloo_advantages
from rlbus.learner.algorithms.policy_loss import actor_policy_loss


@pytest.mark.parametrize("value", [2.2, 0.1, 1 / 3, 0.7, 123.456, 1e-3])
@pytest.mark.parametrize("size", [2, 5, 8, 16, 64])
def test_all_equal_group_has_exactly_zero_advantage_in_float32(value: float, size: int) -> None:
    rewards = torch.full((size,), value, dtype=torch.float32)
    groups = torch.zeros(size, dtype=torch.long)
    mask = torch.ones(size, 3)
    assert torch.count_nonzero(grpo_advantages(rewards, groups, mask)) == 0
    assert torch.count_nonzero(rloo_advantages(rewards, groups, mask)) == 0


def test_vanilla_applies_the_dual_clip_like_verl() -> None:
    """Ratios 5 and 0.5 on negative advantages, clip 0.2, c = 3: per-token max(-A r, -A clip(r)) is 5 and
    0.8; verl's vanilla bounds the first by -A c = 3, so token-mean = (3 + 0.8) / 2 = 1.9 (not 2.9)."""
    logprobs = torch.tensor([[math.log(5.0), math.log(0.5)]])
    old = torch.zeros(1, 2)
    adv = torch.full((1, 2), -1.0)
    mask = torch.ones(1, 2)
    for name in ("vanilla", "dual_clip"):
        loss, stats = actor_policy_loss(name, logprobs, old, adv, mask, 0.2, 0.2, 3.0, "token-mean")
        assert loss.item() == pytest.approx(1.9, abs=1e-6)
        assert stats["dual_clip_frac"].item() == pytest.approx(0.5)


def test_gspo_aggregates_seq_mean_token_mean_whatever_the_mode() -> None:
    """Sequence A (2 tokens, log-ratios 0.1 and 0.3: s = e^0.2, clipped to 1 + 4e-4, A = +1) loses -1.0004 per
    token; sequence B (1 valid token, ratio 1, A = -2) loses 2. seq-mean-token-mean = (-1.0004 + 2) / 2."""
    logprobs = torch.tensor([[0.1, 0.3], [0.0, 0.0]])
    old = torch.zeros(2, 2)
    adv = torch.tensor([[1.0, 1.0], [-2.0, -2.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    expected = (-1.0004 + 2.0) / 2
    for mode in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean"):
        loss, _ = actor_policy_loss("gspo", logprobs, old, adv, mask, 3e-4, 4e-4, 3.0, mode)
        assert loss.item() == pytest.approx(expected, abs=1e-6)


def test_keys_that_mean_nothing_here_are_warned_about() -> None:
    cfg = load_config(
        None,
        [
            "critic.model.path=/m",
            "critic.optim.lr=1e-5",
            "trainer.total_epochs=15",
            "actor_rollout_ref.actor.policy_loss=gspo",
            "actor.loss_agg_mode=token-mean",
        ],
    )
    warnings = "\n".join(inert_key_warnings(cfg))
    assert "critic." in warnings and "algorithm.adv_estimator=gae" in warnings
    assert "trainer.total_epochs=15" in warnings and "trainer.total_training_steps=150" in warnings
    assert "actor.loss_agg_mode=token-mean has no effect" in warnings
    assert inert_key_warnings(load_config(None, [])) == []
    gae = load_config(None, ["algorithm.adv_estimator=gae", "critic.optim.lr=1e-5"])
    assert not any("critic." in w for w in inert_key_warnings(gae))
    vllm = load_config(None, ["rollout.name=vllm", "rollout.decode_small_bucket=true"])
    assert "rollout.decode_small_bucket has no effect with rollout.name=vllm" in inert_key_warnings(vllm)
    assert inert_key_warnings(load_config(None, ["rollout.decode_small_bucket=true"])) == []
    sglang = load_config(None, ["rollout.name=sglang", "rollout.decode_step=recorded"])
    assert "rollout.decode_step has no effect with rollout.name=sglang" in inert_key_warnings(sglang)
    eager = load_config(None, ["rollout.enforce_eager=true", "rollout.decode_step=recorded"])
    assert "rollout.decode_step has no effect with rollout.enforce_eager=true" in " ".join(
        inert_key_warnings(eager)
    )
    assert inert_key_warnings(load_config(None, ["rollout.decode_step=recorded"])) == []


def test_tensorboard_dir_follows_verl(tmp_path, monkeypatch) -> None:
    """verl writes TensorBoard events to $TENSORBOARD_DIR/<project>/<experiment> when the variable is set."""
    from rlbus.metrics_log import tensorboard_dir

    monkeypatch.setenv("TENSORBOARD_DIR", str(tmp_path / "tb"))
    assert tensorboard_dir(tmp_path / "run", "gsm8k", "qwen-grpo") == tmp_path / "tb" / "gsm8k" / "qwen-grpo"
    monkeypatch.delenv("TENSORBOARD_DIR")
    assert tensorboard_dir(tmp_path / "run", "gsm8k", "qwen-grpo") == tmp_path / "run" / "tensorboard"


def test_verls_policy_loss_mode_spelling_selects_the_loss() -> None:
    """verl's current `actor_rollout_ref.actor.policy_loss.loss_mode=gspo` selects GSPO, in an override and in
    YAML; a mode rlbus does not have is refused naming the ones it has."""
    cfg = load_config(None, ["actor_rollout_ref.actor.policy_loss.loss_mode=gspo"])
    assert cfg.actor.policy_loss == "gspo"
    with pytest.raises(ConfigError, match="unknown policy loss 'kl-cov'.*vanilla, dual_clip, gspo"):
        load_config(None, ["actor_rollout_ref.actor.policy_loss.loss_mode=kl-cov"])


def test_the_deploy_guides_rollout_micro_batch_is_the_prompts_a_replica_generates_together() -> None:
    cfg = load_config(None, ["actor_rollout_ref.rollout.micro_batch_size_per_gpu=16"])
    assert cfg.rollout.prompts_per_batch == 16
