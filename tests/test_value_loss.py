"""Clipped value loss against a hand-computed case."""

import torch

from rlbus.learner.algorithms import clipped_value_loss


def close(actual, expected, atol=1e-6):
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), atol=atol, rtol=0)


# clip 0.1. Token 0: V 1.0, V_old 0.8 -> clipped V 0.9, R 2: (1-2)^2 = 1 < (0.9-2)^2 = 1.21 -> 1.21 (clipped,
#   the clipped branch is constant in V: no gradient).
# Token 1: V 2.0, V_old 2.5 -> clipped 2.4, R 3: (2-3)^2 = 1 > (2.4-3)^2 = 0.36 -> 1 (d/dV = 2(V-R) = -2).
# Token 2: V 0, V_old 0, R 0.1: both 0.01, not counted as clipped (d/dV = 2(0-0.1) = -0.2).
# Token 3: padding.
# loss = 0.5 * (1.21 + 1 + 0.01) / 3 = 0.37; grads 0.5 * [0, -2, -0.2] / 3.
VALUES = [[1.0, 2.0, 0.0, 5.0]]
OLD = torch.tensor([[0.8, 2.5, 0.0, 0.0]])
RETURNS = torch.tensor([[2.0, 3.0, 0.1, 0.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0, 0.0]])


def test_clipped_value_loss_hand_case():
    values = torch.tensor(VALUES, requires_grad=True)
    loss, clipfrac = clipped_value_loss(values, OLD, RETURNS, MASK, clip_range=0.1)
    close(loss, 0.37)
    close(clipfrac, 1.0 / 3.0)
    loss.backward()
    close(values.grad, [[0.0, -1.0 / 3.0, -0.1 / 3.0, 0.0]])


def test_value_loss_without_clip_and_seq_mode():
    # Plain 0.5 * MSE: 0.5 * (1 + 1 + 0.01) / 3 = 0.335.
    values = torch.tensor(VALUES, requires_grad=True)
    loss, clipfrac = clipped_value_loss(values, OLD, RETURNS, MASK, clip_range=None)
    close(loss, 0.335)
    close(clipfrac, 0.0)
    # seq-mean-token-sum, one sequence: 0.5 * (1.21 + 1 + 0.01) = 1.11.
    loss, _ = clipped_value_loss(
        values, OLD, RETURNS, MASK, clip_range=0.1, loss_agg_mode="seq-mean-token-sum"
    )
    close(loss, 1.11)
