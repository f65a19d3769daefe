"""Policy losses against hand-computed cases, including which tokens receive gradient."""

import math

import pytest
import torch

from rlbus.learner.algorithms import (
    aggregate_loss,
    gspo_loss,
    ppo_clip_loss,
    truncated_is_weights,
)


def close(actual, expected, atol=1e-5):
    actual = torch.as_tensor(actual)
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), atol=atol, rtol=0)


def log(x):
    return math.log(x)


# ---------------------------------------------------------------- aggregate_loss

LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 7.0, 7.0]])
MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])  # last row empty


def test_aggregate_modes():
    close(aggregate_loss(LOSS, MASK, "token-mean"), 7.0 / 3.0)  # (1 + 2 + 4) / 3
    close(aggregate_loss(LOSS, MASK, "seq-mean-token-sum"), 3.5)  # (3 + 4) / 2 non-empty rows
    close(aggregate_loss(LOSS, MASK, "seq-mean-token-mean"), 2.75)  # (1.5 + 4) / 2
    close(aggregate_loss(LOSS, MASK, "seq-mean-token-sum-norm", norm_length=4), 0.875)  # (3/4 + 4/4) / 2
    close(aggregate_loss(LOSS, MASK, "seq-mean-token-sum-norm"), 7.0 / 6.0)  # default norm_length T=3


def test_aggregate_global_normalisers_make_micro_batches_add_up():
    # Full batch token-mean = 7/3; as two micro-batches each divided by the global count 3: 3/3 + 4/3.
    first = aggregate_loss(LOSS[:1], MASK[:1], "token-mean", global_tokens=3)
    second = aggregate_loss(LOSS[1:], MASK[1:], "token-mean", global_tokens=3)
    close(first, 1.0)
    close(first + second, 7.0 / 3.0)
    # seq-mean-token-mean over 2 sequences: 1.5/2 + 4/2 = 2.75.
    first = aggregate_loss(LOSS[:1], MASK[:1], "seq-mean-token-mean", global_seqs=2)
    second = aggregate_loss(LOSS[1:], MASK[1:], "seq-mean-token-mean", global_seqs=2)
    close(first + second, 2.75)


def test_aggregate_bool_mask_and_unknown_mode():
    close(aggregate_loss(LOSS, MASK.bool(), "token-mean"), 7.0 / 3.0)
    with pytest.raises(ValueError, match="loss_agg_mode"):
        aggregate_loss(LOSS, MASK, "sum")


# ---------------------------------------------------------------- PPO clip

# Ratios [1.5, 0.5, 1.1, (pad)], advantages [1, 1, -1, 5], clip 0.2 / 0.2:
#   t0: A>0, r=1.5: max(-1.5, -1.2) = -1.2 (clipped, no gradient)
#   t1: A>0, r=0.5: max(-0.5, -0.8) = -0.5 (unclipped, d/dlogp = -A*r = -0.5)
#   t2: A<0, r=1.1: max(1.1, 1.1) = 1.1 (inside the range, d/dlogp = -A*r = 1.1)
RATIOS = [1.5, 0.5, 1.1, 1.0]
OLD = torch.tensor([[-1.0, -2.0, -0.5, -3.0]])
ADV = torch.tensor([[1.0, 1.0, -1.0, 5.0]])
PPO_MASK = torch.tensor([[1.0, 1.0, 1.0, 0.0]])


def new_logprobs(ratios=RATIOS, old=OLD):
    return (old + torch.tensor([[log(r) for r in ratios]])).requires_grad_(True)


def test_ppo_clip_value_stats_and_gradient():
    logp = new_logprobs()
    loss, stats = ppo_clip_loss(logp, OLD, ADV, PPO_MASK)
    close(loss, -0.2)  # (-1.2 - 0.5 + 1.1) / 3
    close(stats["clipfrac"], 1.0 / 3.0)
    close(stats["approx_kl"], 0.06412396)  # -(ln 1.5 + ln 0.5 + ln 1.1) / 3
    close(stats["ratio_mean"], 3.1 / 3.0)
    close(stats["dual_clip_frac"], 0.0)
    loss.backward()
    close(logp.grad, [[0.0, -0.5 / 3.0, 1.1 / 3.0, 0.0]])


def test_ppo_clip_higher_is_asymmetric():
    # clip_low 0.2, clip_high 0.28: A>0 r=1.5 -> -1.28; A<0 r=0.5 -> max(0.5, 0.8) = 0.8 (lower clip).
    logp = new_logprobs([1.5, 0.5], OLD[:, :2])
    loss, stats = ppo_clip_loss(logp, OLD[:, :2], torch.tensor([[1.0, -1.0]]), torch.ones(1, 2), 0.2, 0.28)
    close(loss, (-1.28 + 0.8) / 2)
    close(stats["clipfrac"], 1.0)
    loss.backward()
    close(logp.grad, [[0.0, 0.0]])


def test_ppo_dual_clip_bounds_negative_advantages():
    # A = -1 everywhere, c = 3. r=5: max(5, 1.2) = 5 -> min(5, 3) = 3 (dual-clipped, no gradient).
    # r=2: max(2, 1.2) = 2 < 3 -> 2 (gradient -A*r = 2). r=0.5: max(0.5, 0.8) = 0.8 (normal clip).
    old = torch.zeros(1, 3)
    logp = new_logprobs([5.0, 2.0, 0.5], old)
    adv = -torch.ones(1, 3)
    loss, stats = ppo_clip_loss(logp, old, adv, torch.ones(1, 3), dual_clip_c=3.0)
    close(loss, (3.0 + 2.0 + 0.8) / 3)
    close(stats["dual_clip_frac"], 1.0 / 3.0)
    loss.backward()
    close(logp.grad, [[0.0, 2.0 / 3.0, 0.0]])
    # Without the dual clip the huge-ratio token dominates: (5 + 2 + 0.8) / 3.
    loss_plain, _ = ppo_clip_loss(logp.detach(), old, adv, torch.ones(1, 3))
    close(loss_plain, 7.8 / 3)


def test_ppo_dual_clip_ignores_positive_advantages_and_validates_c():
    # A = +1, r = 5 is already bounded by the normal clip: -1.2.
    old = torch.zeros(1, 1)
    loss, stats = ppo_clip_loss(
        new_logprobs([5.0], old), old, torch.ones(1, 1), torch.ones(1, 1), dual_clip_c=3.0
    )
    close(loss, -1.2)
    close(stats["dual_clip_frac"], 0.0)
    with pytest.raises(ValueError, match="dual_clip_c"):
        ppo_clip_loss(old, old, old, torch.ones(1, 1), dual_clip_c=1.0)


def test_ppo_is_weights_multiply_the_token_loss():
    # Per-token losses [-1.2, -0.5, 1.1] times weights [0.5, 2, 1] = [-0.6, -1.0, 1.1] -> mean -0.5/3.
    logp = new_logprobs()
    weights = torch.tensor([[0.5, 2.0, 1.0, 0.0]])
    loss, _ = ppo_clip_loss(logp, OLD, ADV, PPO_MASK, is_weights=weights)
    close(loss, -0.5 / 3.0)
    loss.backward()
    close(logp.grad, [[0.0, -1.0 / 3.0, 1.1 / 3.0, 0.0]])


def test_ppo_on_policy_ratio_one_is_minus_mean_advantage():
    # logp == old: ratio 1, loss = -mean(A) over valid tokens = -(1 + 1 - 1) / 3; gradient -A / 3.
    logp = OLD.clone().requires_grad_(True)
    loss, stats = ppo_clip_loss(logp, OLD, ADV, PPO_MASK, loss_agg_mode="seq-mean-token-sum")
    close(loss, -1.0)  # one sequence, token sum -(1 + 1 - 1)
    close(stats["approx_kl"], 0.0)
    close(stats["clipfrac"], 0.0)
    loss.backward()
    close(logp.grad, [[-1.0, -1.0, 1.0, 0.0]])


# ---------------------------------------------------------------- GSPO


def test_gspo_sequence_ratio_value_and_gradient_reach_every_token():
    # Wide clips (no clipping). Seq 0: log-ratios [ln 2, 0], A = 1: s0 = exp(ln2 / 2) = sqrt 2; each token's
    # loss is -sqrt 2; d/dlogp_t = -A * s0 / L0 / n_seqs = -1.41421356 / 2 / 2 = -0.35355339 on BOTH tokens
    # (the second token's own ratio is 1, yet it gets the sequence's gradient).
    # Seq 1: mask [1, 0], log-ratio [ln 3, (pad)], A = -2: s1 = 3, loss 6, grad 2 * 3 / 1 / 2 = 3.
    # loss = (-sqrt 2 + 6) / 2 = 2.29289322.
    old = torch.tensor([[-1.0, -1.0], [-2.0, -2.0]])
    logp = (old + torch.tensor([[log(2.0), 0.0], [log(3.0), 0.7]])).requires_grad_(True)
    adv = torch.tensor([[1.0, 1.0], [-2.0, -2.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    loss, stats = gspo_loss(logp, old, adv, mask, clip_low=10.0, clip_high=10.0)
    close(loss, 2.29289322)
    close(stats["ratio_mean"], (1.41421356 + 3.0) / 2)
    close(stats["clipfrac"], 0.0)
    loss.backward()
    close(logp.grad, [[-0.35355339, -0.35355339], [3.0, 0.0]])


def test_gspo_clipped_sequence_gets_no_gradient_at_all():
    # Default clips 3e-4 / 4e-4. Seq 0: s0 = sqrt 2 > 1.0004 with A > 0 -> clipped: loss -1.0004 per token,
    # no gradient on either token. Seq 1: log-ratios [0, 0], s1 = 1, A = 1 -> loss -1, grad -1 / 2 / 2.
    old = torch.zeros(2, 2)
    logp = torch.tensor([[log(2.0), 0.0], [0.0, 0.0]], requires_grad=True)
    adv = torch.ones(2, 2)
    loss, stats = gspo_loss(logp, old, adv, torch.ones(2, 2))
    close(loss, (-1.0004 - 1.0) / 2)
    close(stats["clipfrac"], 0.5)
    loss.backward()
    close(logp.grad, [[0.0, 0.0], [-0.25, -0.25]])


# ---------------------------------------------------------------- truncated IS


def test_truncated_is_weights_token_and_sequence():
    # old - behaviour = [ln 0.5, ln 3, ln 1.5, (pad)]; cap 2 -> [0.5, 2, 1.5, 0].
    behaviour = torch.tensor([[-1.0, -1.0, -1.0, -1.0]])
    old = (behaviour + torch.tensor([[log(0.5), log(3.0), log(1.5), 5.0]])).requires_grad_(True)
    mask = torch.tensor([[1, 1, 1, 0]])
    w = truncated_is_weights(old, behaviour, mask, cap=2.0)
    assert not w.requires_grad
    close(w, [[0.5, 2.0, 1.5, 0.0]])
    # Sequence level: product 0.5 * 3 * 1.5 = 2.25 (padding excluded) -> capped at 2, or 2.25 under cap 3.
    close(truncated_is_weights(old, behaviour, mask, cap=2.0, level="sequence"), [[2.0, 2.0, 2.0, 0.0]])
    close(truncated_is_weights(old, behaviour, mask, cap=3.0, level="sequence"), [[2.25, 2.25, 2.25, 0.0]])


def test_truncated_is_weights_huge_log_ratio_does_not_overflow():
    w = truncated_is_weights(torch.tensor([[1000.0]]), torch.tensor([[0.0]]), torch.ones(1, 1), cap=2.0)
    close(w, [[2.0]])
    with pytest.raises(ValueError):
        truncated_is_weights(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), level="geometric")


# ---------------------------------------------------------------- entropy
