"""DPO / IPO / hinge, KTO and SimPO losses against hand-computed values (TRL definitions)."""

import pytest
import torch

from rlbus.learner.algorithms import dpo_loss, kto_loss, sequence_logps, simpo_loss


def close(actual, expected, atol=1e-6):
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), atol=atol, rtol=0)


# Sample 0: pi_c -1, pi_r -3, ref_c -2, ref_r -2 -> logits = (-1 + 3) - 0 = 2, beta*logits = 0.2.
# Sample 1: pi_c -2, pi_r -2, ref_c -2, ref_r -2 -> logits 0.
PC = torch.tensor([-1.0, -2.0])
PR = torch.tensor([-3.0, -2.0])
RC = torch.tensor([-2.0, -2.0])
RR = torch.tensor([-2.0, -2.0])


def test_dpo_sigmoid():
    # -log sigmoid(0.2) = log(1 + e^-0.2) = 0.59813887; logits 0 -> log 2 = 0.69314718.
    losses, chosen, rejected = dpo_loss(PC, PR, RC, RR, beta=0.1)
    close(losses, [0.59813887, 0.69314718])
    close(chosen, [0.1, 0.0])  # 0.1 * (-1 + 2)
    close(rejected, [-0.1, 0.0])  # 0.1 * (-3 + 2)


def test_dpo_label_smoothing():
    # 0.9 * 0.59813887 + 0.1 * (-log sigmoid(-0.2) = 0.59813887 + 0.2) = 0.61813887; logits 0 -> log 2.
    losses, _, _ = dpo_loss(PC, PR, RC, RR, beta=0.1, label_smoothing=0.1)
    close(losses, [0.61813887, 0.69314718])


def test_ipo_and_hinge():
    # IPO: (logits - 1/(2*0.1))^2 = (2 - 5)^2 = 9; (0 - 5)^2 = 25.
    losses, _, _ = dpo_loss(PC, PR, RC, RR, beta=0.1, loss_type="ipo")
    close(losses, [9.0, 25.0])
    # Hinge: relu(1 - 0.1 * 2) = 0.8; relu(1 - 0) = 1; a margin of 20 -> relu(1 - 2) = 0.
    losses, _, _ = dpo_loss(PC, PR, RC, RR, beta=0.1, loss_type="hinge")
    close(losses, [0.8, 1.0])
    losses, _, _ = dpo_loss(
        torch.tensor([0.0]), torch.tensor([-20.0]), torch.zeros(1), torch.zeros(1), 0.1, "hinge"
    )
    close(losses, [0.0])
    with pytest.raises(ValueError):
        dpo_loss(PC, PR, RC, RR, loss_type="orpo")


def test_dpo_gradient_direction():
    # d/d pi_c of -log sigmoid(beta*logits) = -beta * sigmoid(-beta*logits) < 0: raising pi_c lowers the loss.
    # At logits 0: -0.1 * 0.5 = -0.05 for pi_c and +0.05 for pi_r.
    pc = torch.tensor([-2.0], requires_grad=True)
    pr = torch.tensor([-2.0], requires_grad=True)
    losses, chosen, _ = dpo_loss(pc, pr, RC[:1], RR[:1], beta=0.1)
    losses.sum().backward()
    close(pc.grad, [-0.05])
    close(pr.grad, [0.05])
    assert not chosen.requires_grad


def test_kto():
    # logratios: 1 (desirable), -1 (undesirable); KL 0.5, beta 0.1.
    # desirable: 1 - sigmoid(0.1 * (1 - 0.5)) = 1 - sigmoid(0.05) = 0.48750260
    # undesirable: 1 - sigmoid(0.1 * (0.5 + 1)) = 1 - sigmoid(0.15) = 0.46257015; x 1.33 = 0.61521831
    policy = torch.tensor([-1.0, -3.0])
    ref = torch.tensor([-2.0, -2.0])
    desirable = torch.tensor([True, False])
    losses, rewards = kto_loss(policy, ref, desirable, torch.tensor(0.5), beta=0.1)
    close(losses, [0.48750260, 0.46257015])
    close(rewards, [0.1, -0.1])
    losses, _ = kto_loss(policy, ref, desirable, torch.tensor(0.5), beta=0.1, undesirable_weight=1.33)
    close(losses, [0.48750260, 0.61521831])


def test_kto_kl_is_clamped_and_detached():
    # A negative KL estimate is clamped to 0: desirable 1 - sigmoid(0.1 * 1) = 0.47502081.
    kl = torch.tensor(-1.0, requires_grad=True)
    losses, _ = kto_loss(torch.tensor([-1.0]), torch.tensor([-2.0]), torch.tensor([True]), kl, beta=0.1)
    close(losses, [0.47502081])
    assert not losses.requires_grad  # nothing but the (detached) KL required grad


def test_simpo():
    # beta 2, gamma 0.5: 2 * (-0.5 + 1.0) - 0.5 = 0.5 -> -log sigmoid(0.5) = 0.47407698.
    losses, chosen, rejected = simpo_loss(torch.tensor([-0.5]), torch.tensor([-1.0]))
    close(losses, [0.47407698])
    close(chosen, [-1.0])
    close(rejected, [-2.0])
    # label smoothing 0.1: 0.9 * 0.47407698 + 0.1 * (0.47407698 + 0.5) = 0.52407698.
    losses, _, _ = simpo_loss(torch.tensor([-0.5]), torch.tensor([-1.0]), label_smoothing=0.1)
    close(losses, [0.52407698])


def test_sequence_logps():
    token_logps = torch.tensor([[-1.0, -2.0, -3.0], [-4.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [0, 0, 0]])
    close(sequence_logps(token_logps, mask), [-3.0, 0.0])
    close(sequence_logps(token_logps, mask, average=True), [-1.5, 0.0])
