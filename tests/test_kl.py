"""KL estimators and KL controllers against hand-computed values."""

import pytest
import torch

from rlbus.learner.algorithms import AdaptiveKLController, FixedKLController, build_kl_controller, kl_estimate


def close(actual, expected, atol=1e-6):
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), atol=atol, rtol=0)


# Token 0: logp -1, ref -2 (logp - ref = 1); token 1: logp -2, ref -1 (logp - ref = -1); token 2: equal.
LOGP = torch.tensor([[-1.0, -2.0, -0.5]])
REF = torch.tensor([[-2.0, -1.0, -0.5]])


def test_k1_k2_abs():
    close(kl_estimate(LOGP, REF, "k1"), [[1.0, -1.0, 0.0]])
    close(kl_estimate(LOGP, REF, "kl"), [[1.0, -1.0, 0.0]])
    close(kl_estimate(LOGP, REF, "abs"), [[1.0, 1.0, 0.0]])
    close(kl_estimate(LOGP, REF, "k2"), [[0.5, 0.5, 0.0]])  # 0.5 * (+-1)^2
    close(kl_estimate(LOGP, REF, "mse"), [[0.5, 0.5, 0.0]])


def test_k3_low_var_kl():
    # ref - logp = -1: e^-1 + 1 - 1 = 0.36787944; ref - logp = 1: e^1 - 1 - 1 = 0.71828183; equal: 0.
    close(kl_estimate(LOGP, REF, "k3"), [[0.36787944, 0.71828183, 0.0]])
    close(kl_estimate(LOGP, REF, "low_var_kl"), [[0.36787944, 0.71828183, 0.0]])


def test_k3_is_clamped():
    # logp 0, ref -30: diff clamped to -20: e^-20 + 20 - 1 ~= 19 -> clamped to 10.
    # logp -30, ref 0: diff clamped to 20: e^20 - 21 -> clamped to 10 (and no inf).
    close(kl_estimate(torch.tensor([0.0, -30.0]), torch.tensor([-30.0, 0.0]), "k3"), [10.0, 10.0])


def test_k3_gradient_vanishes_at_equality():
    logp = torch.tensor([-0.5], requires_grad=True)
    kl_estimate(logp, torch.tensor([-0.5]), "k3").sum().backward()
    close(logp.grad, [0.0])  # d/dlogp [e^(ref-logp) - (ref-logp) - 1] = -e^0 + 1 = 0


def test_unknown_kind():
    with pytest.raises(ValueError, match="KL kind"):
        kl_estimate(LOGP, REF, "k4")


def test_fixed_controller():
    ctrl = FixedKLController(0.05)
    ctrl.update(current_kl=100.0, n_steps=1000)
    assert ctrl.value == 0.05


def test_adaptive_controller_steps():
    ctrl = AdaptiveKLController(init_kl_coef=0.1, target_kl=6.0, horizon=10000)
    # 9/6 - 1 = 0.5 -> clipped 0.2: coef *= 1 + 0.2 * 100 / 10000 = 1.002 -> 0.1002
    ctrl.update(current_kl=9.0, n_steps=100)
    assert ctrl.value == pytest.approx(0.1002, abs=1e-12)
    # 3/6 - 1 = -0.5 -> clipped -0.2: coef *= 1 - 0.2 * 500 / 10000 = 0.99 -> 0.099198
    ctrl.update(current_kl=3.0, n_steps=500)
    assert ctrl.value == pytest.approx(0.099198, abs=1e-12)
    # 6.6/6 - 1 = 0.1 (inside the clip): coef *= 1 + 0.1 * 1000 / 10000 = 1.01 -> 0.10018998
    ctrl.update(current_kl=6.6, n_steps=1000)
    assert ctrl.value == pytest.approx(0.10018998, abs=1e-12)
    # At the target the coefficient does not move.
    ctrl.update(current_kl=6.0, n_steps=1000)
    assert ctrl.value == pytest.approx(0.10018998, abs=1e-12)


def test_build_kl_controller():
    fixed = build_kl_controller("fixed", kl_coef=0.01)
    assert isinstance(fixed, FixedKLController) and fixed.value == 0.01
    adaptive = build_kl_controller("adaptive", kl_coef=0.2, target_kl=1.0, horizon=100)
    assert isinstance(adaptive, AdaptiveKLController) and adaptive.value == 0.2
    with pytest.raises(ValueError):
        build_kl_controller("adaptive", kl_coef=0.2)
    with pytest.raises(ValueError):
        build_kl_controller("pid", kl_coef=0.2)
    with pytest.raises(ValueError):
        AdaptiveKLController(0.1, target_kl=0.0, horizon=10)
