"""RL algorithms through the real services (learner, rollout, reward as OS processes over NATS).

The short runs check the algorithms whose wiring involves more than the learner's update: DAPO (the gather
drops all-equal groups and dispatches more), PPO with a critic (the value model's metrics and update), GSPO
(sequence-level clipping over a real run). The estimators whose difference is the learner's math alone
(GRPO, RLOO, REINFORCE++, Dr. GRPO) are checked in-process against one learner
(tests/test_learner_unit.py). The long runs check that GRPO and PPO with a critic actually raise greedy
held-out accuracy on the embedded addition task.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from e2e_utils import Run, make_config

SHORT_STEPS = 6
SHORT = [
    f"trainer.total_training_steps={SHORT_STEPS}",
    "trainer.async_level=1",
    "rollout.replicas=1",
    "data.train_batch_size=4",
    "rollout.n=4",
    "rollout.prompts_per_batch=4",
    "trainer.test_freq=-1",
    "trainer.val_before_train=false",
    # two optimizer steps per batch: the second one's ratios differ from 1, so the clips are exercised
    "actor.ppo_mini_batch_size=2",
]

ALGORITHMS: dict[str, list[str]] = {
    "grpo": ["algorithm.adv_estimator=grpo"],
    "ppo_gae": [
        "algorithm.adv_estimator=gae",
        "algorithm.gamma=1.0",
        "algorithm.lam=1.0",
        "critic.optim.lr=1e-4",
    ],
    "rloo": ["algorithm.adv_estimator=rloo"],
    "reinforce_plus_plus": ["algorithm.adv_estimator=reinforce_plus_plus"],
    "dapo": [
        "algorithm.adv_estimator=grpo",
        "actor.clip_ratio_low=0.2",
        "actor.clip_ratio_high=0.28",
        "algorithm.dynamic_sampling=true",
        "actor.loss_agg_mode=token-mean",
        "algorithm.overlong_buffer_len=4",
        "algorithm.overlong_penalty_factor=1.0",
    ],
    "gspo": [
        "algorithm.adv_estimator=grpo",
        "actor.policy_loss=gspo",
        "actor.clip_ratio_low=3e-4",
        "actor.clip_ratio_high=4e-4",
        "actor.loss_agg_mode=seq-mean-token-mean",
    ],
    "dr_grpo": ["algorithm.adv_estimator=dr_grpo", "actor.loss_agg_mode=seq-mean-token-sum-norm"],
}


def _finite(rows: list[dict], key: str) -> bool:
    return all(key in r and math.isfinite(r[key]) for r in rows)


THROUGH_THE_SERVICES = ("ppo_gae", "dapo", "gspo")


@pytest.mark.timeout(400)
@pytest.mark.parametrize("algo", THROUGH_THE_SERVICES)
def test_algorithm_trains_through_the_services(algo: str, nats_url: str, run_id: str, tmp_path: Path) -> None:
    cfg = make_config(nats_url, run_id, tmp_path, [*SHORT, *ALGORITHMS[algo]])
    with Run(cfg) as run:
        rc = run.wait_learner(300)
        assert rc == 0, run.logs("learner")
        rows = run.metrics()
        ledger = run.ledger()
    train = [r for r in rows if "actor/loss" in r]
    assert len(train) == SHORT_STEPS
    for key in ("actor/loss", "actor/pg_loss", "actor/grad_norm", "actor/entropy", "reward/accuracy"):
        assert _finite(train, key), (key, [r.get(key) for r in train])
    assert any(r["actor/grad_norm"] > 0 for r in train)
    # every step trained a full batch: exactly train_batch_size groups each
    assert len(ledger["trained"]) == SHORT_STEPS * cfg.data.train_batch_size
    if algo == "gspo":  # sequence-level ratios after one step are far outside 1 +- 4e-4
        assert max(r["actor/clipfrac"] for r in train) > 0.2, [r["actor/clipfrac"] for r in train]
    if algo == "ppo_gae":
        for key in (
            "critic/vf_loss",
            "critic/vf_clipfrac",
            "critic/values_mean",
            "critic/explained_variance",
        ):
            assert _finite(train, key), (key, [r.get(key) for r in train])
        assert train[0]["critic/values_mean"] == 0.0  # zero-init head
        assert train[-1]["critic/values_mean"] != 0.0  # ... that the value update moved
    if algo == "dapo":
        # all-equal groups are dropped in the gather and refilled by dispatching more prompts
        filtered = train[-1]["dapo/filtered_total"]
        assert filtered > 0, [r["dapo/filtered_total"] for r in train]
        dropped = [reason for reason in ledger["dropped"].values() if reason == "zero_variance"]
        assert len(dropped) == filtered
        assert len(ledger["dispatched"]) >= SHORT_STEPS * cfg.data.train_batch_size + filtered
        assert _finite(train, "dapo/overlong_penalty_mean")
        assert all(r["reward/std"] > 0 for r in train)


RISING = [
    "trainer.total_training_steps=100",
    "trainer.async_level=1",
    "rollout.replicas=1",
    "data.train_batch_size=16",
    "rollout.n=8",
    "trainer.test_freq=50",
    "trainer.val_before_train=true",
    "data.num_val_examples=256",
    "data.val_batch_size=256",
]


# ~1 min on an idle 2-core box, ~2 min on a loaded one: `make test-slow` (part of CI) runs it. GRPO's rise is
# checked there by test_e2e_grpo's async two-replica run (one GRPO accuracy test, not two).
@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("algo", ["ppo_gae"])
def test_accuracy_rises(algo: str, nats_url: str, run_id: str, tmp_path: Path) -> None:
    """Greedy accuracy on 256 held-out prompts: the warm start gets ~0.5, 100 steps add 15-20 points."""
    cfg = make_config(nats_url, run_id, tmp_path, [*RISING, *ALGORITHMS[algo]])
    with Run(cfg) as run:
        rc = run.wait_learner(800)
        assert rc == 0, run.logs("learner")
        rows = run.metrics()
    train = [r for r in rows if "reward/accuracy" in r]
    val = [r["val/accuracy"] for r in rows if "val/accuracy" in r]
    assert len(train) == 100 and len(val) == 3  # before training, at step 50, after the last step
    # One evaluation's standard error is ~3.1 points (~4.4 for a difference of two); a random-direction
    # update adds nothing. Accuracy plateaus after ~50 steps and wobbles there, so: the better of the two
    # later evaluations is 12 points up, and the final one still 8 points up.
    assert max(val[1:]) > val[0] + 0.12 and val[-1] > val[0] + 0.08, f"{algo}: val accuracy {val}"
    # Sampled (T=0.7) accuracy, in 25-step means: one step's sd is ~6 points, so a mean's standard error is
    # ~1.2 and the rise's ~1.7. Measured rises: +5.8, +6.3, +7.0 (this box, 2026-12-06) and +2.9 (a CI run),
    # so the bar is 1 point: about 3 standard errors under the typical rise (the CI run's sat 1 over it). The
    # held-out check above tells learning from noise; this one says the training reward the user watches rises.
    start = float(np.mean([r["reward/accuracy"] for r in train[:25]]))
    end = float(np.mean([r["reward/accuracy"] for r in train[-25:]]))
    assert end > start + 0.01, f"{algo}: sampled accuracy {start:.3f} -> {end:.3f}"
    assert all(math.isfinite(r["actor/loss"]) for r in train)
    if algo == "ppo_gae":
        # the zero-init critic learns at least the level of the return (here: the mean reward)
        values = float(np.mean([r["critic/values_mean"] for r in train[-10:]]))
        assert train[0]["critic/values_mean"] == 0.0 and abs(values - end) < 0.15, (values, end)
