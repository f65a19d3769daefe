"""Advantage estimators against hand-computed cases (expected numbers are written out, never recomputed)."""

import pytest
import torch

from rlbus.learner.algorithms import (
    compute_advantages,
    dr_grpo_advantages,
    gae_advantages,
    grpo_advantages,
    reinforce_plus_plus_advantages,
    rloo_advantages,
    sequence_to_token_rewards,
)


def close(actual, expected, atol=1e-5):
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), atol=atol, rtol=0)


# Two non-contiguous groups: g7 = rewards {1, 3}, g2 = rewards {0, 0, 3}.
# g7: mean 2, unbiased var ((1)^2 + (1)^2) / 1 = 2, std 1.41421356 -> adv -/+ 0.70710678.
# g2: mean 1, deviations -1, -1, 2, unbiased var 6 / 2 = 3, std 1.73205081 -> -0.57735027, 1.15470054.
REWARDS = torch.tensor([1.0, 0.0, 3.0, 0.0, 3.0])
GROUPS = torch.tensor([7, 2, 7, 2, 2])
MASK = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 0], [0, 0, 0]], dtype=torch.float32)


def test_grpo_non_contiguous_groups_and_padding():
    adv = grpo_advantages(REWARDS, GROUPS, MASK)
    close(
        adv,
        [
            [-0.70710678, -0.70710678, 0.0],
            [-0.57735027, 0.0, 0.0],
            [0.70710678, 0.70710678, 0.70710678],
            [-0.57735027, -0.57735027, 0.0],
            [0.0, 0.0, 0.0],  # the row has no valid token
        ],
    )


def test_grpo_eps_is_added_to_std():
    # {0, 1}: mean 0.5, std sqrt(0.5) = 0.70710678; with eps 0.29289322 the divisor is 1 -> -/+ 0.5.
    adv = grpo_advantages(torch.tensor([0.0, 1.0]), torch.tensor([0, 0]), torch.ones(2, 1), eps=0.29289322)
    close(adv, [[-0.5], [0.5]])


def test_grpo_all_equal_and_singleton_groups_are_zero():
    rewards = torch.tensor([1.0, 1.0, 1.0, 5.0])
    groups = torch.tensor([0, 0, 0, 1])  # group 0 all equal, group 1 has one sample
    mask = torch.ones(4, 2)
    assert torch.equal(grpo_advantages(rewards, groups, mask), torch.zeros(4, 2))
    assert torch.equal(grpo_advantages(rewards, groups, mask, norm_by_std=False), torch.zeros(4, 2))
    assert torch.equal(dr_grpo_advantages(rewards, groups, mask), torch.zeros(4, 2))
    assert torch.equal(rloo_advantages(rewards, groups, mask), torch.zeros(4, 2))


def test_grpo_accepts_bool_mask_and_int_rewards_and_is_detached():
    rewards = torch.tensor([1.0, 3.0], requires_grad=True)
    adv = grpo_advantages(rewards, torch.tensor([0, 0]), torch.tensor([[True, False], [True, True]]))
    assert not adv.requires_grad
    close(adv, [[-0.70710678, 0.0], [0.70710678, 0.70710678]])
    adv_int = grpo_advantages(torch.tensor([1, 3]), torch.tensor([0, 0]), torch.ones(2, 1))
    close(adv_int, [[-0.70710678], [0.70710678]])


def test_dr_grpo_is_mean_centred_only():
    # g7: 1 - 2 = -1, 3 - 2 = 1; g2: 0 - 1 = -1, 3 - 1 = 2.
    adv = dr_grpo_advantages(REWARDS, GROUPS, MASK)
    close(adv, [[-1.0, -1.0, 0.0], [-1.0, 0.0, 0.0], [1.0, 1.0, 1.0], [-1.0, -1.0, 0.0], [0.0, 0.0, 0.0]])


def test_rloo_leave_one_out_baseline():
    # One group {1, 2, 6}, total 9: 1 - 8/2 = -3, 2 - 7/2 = -1.5, 6 - 3/2 = 4.5; a singleton gets 0.
    rewards = torch.tensor([1.0, 9.0, 2.0, 6.0])
    groups = torch.tensor([3, 4, 3, 3])
    mask = torch.tensor([[1, 1], [1, 1], [1, 0], [1, 1]])
    close(rloo_advantages(rewards, groups, mask), [[-3.0, -3.0], [0.0, 0.0], [-1.5, 0.0], [4.5, 4.5]])


def test_reinforce_plus_plus_returns_and_whitening():
    # gamma 0.5. Row 0 rewards [0, 0, 1] -> returns [0.25, 0.5, 1].
    # Row 1 rewards [0, 2, (5 on padding, ignored)] -> returns [1, 2, 0].
    # Valid returns {0.25, 0.5, 1, 1, 2}: mean 0.95, squared deviations sum 1.8, unbiased var 0.45,
    # std 0.67082039 -> (x - 0.95) / 0.67082039.
    token_rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 5.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    adv, returns = reinforce_plus_plus_advantages(token_rewards, mask, gamma=0.5)
    close(returns, [[0.25, 0.5, 1.0], [1.0, 2.0, 0.0]])
    close(adv, [[-1.04349839, -0.67082039, 0.07453560], [0.07453560, 1.56524758, 0.0]])


def test_reinforce_plus_plus_masked_gap_is_skipped():
    # Mask [1, 0, 1] (a tool-output gap): return at t0 = 0 + 0.5 * 1 = 0.5 (gap not discounted), gap 0.
    _, returns = reinforce_plus_plus_advantages(
        torch.tensor([[0.0, 3.0, 1.0]]), torch.tensor([[1.0, 0.0, 1.0]]), gamma=0.5
    )
    close(returns, [[0.5, 0.0, 1.0]])


def test_reinforce_plus_plus_single_token_is_zero_not_nan():
    adv, returns = reinforce_plus_plus_advantages(torch.tensor([[2.0, 0.0]]), torch.tensor([[1.0, 0.0]]))
    assert torch.equal(adv, torch.zeros(1, 2))
    close(returns, [[2.0, 0.0]])


def test_gae_hand_case():
    # gamma 0.9, lam 0.5.
    # Row 0, mask [1, 1, 0], r [0, 1, (4 pad)], V [0.5, 0.8, (9 pad)]; value after the last valid token is 0:
    #   t1: delta = 1 + 0 - 0.8 = 0.2, A1 = 0.2
    #   t0: delta = 0 + 0.9*0.8 - 0.5 = 0.22, A0 = 0.22 + 0.45*0.2 = 0.31; returns 0.81, 1.0
    # Row 1, mask [1, 1, 1], r [0, 0, 2], V [1, 1, 1]:
    #   t2: delta = 2 - 1 = 1, A2 = 1
    #   t1: delta = 0.9 - 1 = -0.1, A1 = -0.1 + 0.45*1 = 0.35
    #   t0: delta = -0.1, A0 = -0.1 + 0.45*0.35 = 0.0575; returns 1.0575, 1.35, 2.0
    # Whitening {0.31, 0.2, 0.0575, 0.35, 1}: mean 0.3835, unbiased var 0.13163625, std 0.36281710.
    rewards = torch.tensor([[0.0, 1.0, 4.0], [0.0, 0.0, 2.0]])
    values = torch.tensor([[0.5, 0.8, 9.0], [1.0, 1.0, 1.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    adv, returns = gae_advantages(rewards, values, mask, gamma=0.9, lam=0.5)
    close(returns, [[0.81, 1.0, 0.0], [1.0575, 1.35, 2.0]])
    close(adv, [[-0.20258141, -0.50576447, 0.0], [-0.89852435, -0.09233302, 1.69920325]])


def test_gae_masked_gap_passes_through():
    # gamma = lam = 1, mask [1, 0, 1], r [0, (7 masked), 1], V [0.5, (9 masked), 0.8]:
    #   t2: delta = 1 - 0.8 = 0.2; t0: next valid value is V2: delta = 0.8 - 0.5 = 0.3, A0 = 0.5.
    #   returns: 0.5 + 0.5 = 1.0, 0, 0.2 + 0.8 = 1.0 (= the undiscounted reward-to-go, as it must).
    _, returns = gae_advantages(
        torch.tensor([[0.0, 7.0, 1.0]]), torch.tensor([[0.5, 9.0, 0.8]]), torch.tensor([[1, 0, 1]]), 1.0, 1.0
    )
    close(returns, [[1.0, 0.0, 1.0]])


def test_sequence_to_token_rewards_with_kl():
    # Score on the last valid token; minus 0.1 * kl on every valid token.
    rewards = torch.tensor([1.0, 2.0, 3.0])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [0, 0, 0]])
    kl = torch.tensor([[0.1, 0.2, 0.3], [0.0, 0.5, -0.5], [1.0, 1.0, 1.0]])
    close(sequence_to_token_rewards(rewards, mask), [[0.0, 1.0, 0.0], [0.0, 0.0, 2.0], [0.0, 0.0, 0.0]])
    close(
        sequence_to_token_rewards(rewards, mask, kl=kl, kl_coef=0.1),
        [[-0.01, 0.98, 0.0], [0.0, -0.05, 2.05], [0.0, 0.0, 0.0]],
    )


def test_sequence_to_token_rewards_left_padding():
    # The last valid token is found by position, not by count: mask [0, 1, 1] -> index 2.
    close(sequence_to_token_rewards(torch.tensor([4.0]), torch.tensor([[0, 1, 1]])), [[0.0, 0.0, 4.0]])


def test_compute_advantages_dispatch():
    mask = torch.ones(2, 1)
    ids = torch.tensor([0, 0])
    adv, ret = compute_advantages("grpo", rewards=torch.tensor([1.0, 3.0]), group_ids=ids, response_mask=mask)
    close(adv, [[-0.70710678], [0.70710678]])
    assert torch.equal(adv, ret)
    adv, _ = compute_advantages(
        "dr_grpo", rewards=torch.tensor([1.0, 3.0]), group_ids=ids, response_mask=mask
    )
    close(adv, [[-1.0], [1.0]])
    # rloo from token rewards (summed per row): {1, 3} -> 1 - 3 = -2, 3 - 1 = 2.
    adv, _ = compute_advantages(
        "rloo",
        token_rewards=torch.tensor([[0.5, 0.5], [1.0, 2.0]]),
        group_ids=ids,
        response_mask=torch.ones(2, 2),
    )
    close(adv, [[-2.0, -2.0], [2.0, 2.0]])
    # reinforce_plus_plus from sequence rewards: returns [1, 1] and [0, 0] -> mean 0.5, var 1/3.
    adv, ret = compute_advantages(
        "reinforce_plus_plus", rewards=torch.tensor([1.0, 0.0]), response_mask=torch.ones(2, 2)
    )
    close(ret, [[1.0, 1.0], [0.0, 0.0]])
    close(adv, [[0.8660254, 0.8660254], [-0.8660254, -0.8660254]])
    # gae with V = 0, gamma = lam = 1 gives the same returns.
    _, ret = compute_advantages(
        "gae", rewards=torch.tensor([1.0, 0.0]), values=torch.zeros(2, 2), response_mask=torch.ones(2, 2)
    )
    close(ret, [[1.0, 1.0], [0.0, 0.0]])


def test_compute_advantages_errors():
    with pytest.raises(ValueError, match="unknown advantage estimator"):
        compute_advantages(
            "ppo2",
            rewards=torch.zeros(1),
            group_ids=torch.zeros(1, dtype=torch.long),
            response_mask=torch.ones(1, 1),
        )
    with pytest.raises(ValueError, match="group_ids"):
        compute_advantages("grpo", rewards=torch.zeros(1), response_mask=torch.ones(1, 1))
    with pytest.raises(ValueError, match="values"):
        compute_advantages("gae", rewards=torch.zeros(1), response_mask=torch.ones(1, 1))
