"""KL estimators between the policy and the reference policy, and KL-coefficient controllers.

The estimators are Schulman's k1/k2/k3 single-sample estimators of KL(pi || pi_ref) computed from the
log-probs of the sampled tokens; they are pure functions of tensors.
"""

from __future__ import annotations

import torch

__all__ = [
    "KL_KINDS",
    "AdaptiveKLController",
    "FixedKLController",
    "build_kl_controller",
    "kl_estimate",
]

KL_KINDS = ("k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl")


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str = "low_var_kl") -> torch.Tensor:
    """Per-token KL estimate of ``KL(pi || pi_ref)`` from sampled-token log-probs (same shape as the inputs).

    Kinds:
        ``k1``/``kl``: ``logp - ref`` (unbiased, high variance, can be negative).
        ``abs``: ``|logp - ref|``.
        ``k2``/``mse``: ``0.5 * (logp - ref)^2``.
        ``k3``/``low_var_kl``: ``exp(ref - logp) - (ref - logp) - 1`` (unbiased, non-negative, low
            variance); as in verl the log-ratio is clamped to [-20, 20] and the result to [-10, 10] so one
            far-off token cannot dominate.
    """
    log_ratio = logprobs - ref_logprobs
    if kind in ("k1", "kl"):
        return log_ratio
    if kind == "abs":
        return log_ratio.abs()
    if kind in ("k2", "mse"):
        return 0.5 * log_ratio.square()
    if kind in ("k3", "low_var_kl"):
        neg = (-log_ratio).clamp(-20.0, 20.0)
        return (torch.exp(neg) - neg - 1.0).clamp(-10.0, 10.0)
    raise ValueError(f"unknown KL kind {kind!r}; expected one of {KL_KINDS}")


class FixedKLController:
    """A constant KL coefficient; ``update`` is a no-op so both controllers share one interface."""

    def __init__(self, kl_coef: float) -> None:
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        del current_kl, n_steps


class AdaptiveKLController:
    """Proportional controller steering the observed KL towards ``target_kl`` (Ziegler et al., 2019).

    ``error = clip(current / target - 1, -0.2, 0.2)`` and ``coef *= 1 + error * n_steps / horizon``: the clip
    bounds how fast the coefficient moves, the horizon sets its time scale in samples/steps.
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int | float) -> None:
        if target_kl <= 0 or horizon <= 0:
            raise ValueError(f"target_kl and horizon must be positive, got {target_kl} and {horizon}")
        self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon


def build_kl_controller(
    type: str = "fixed",
    kl_coef: float = 0.001,
    target_kl: float | None = None,
    horizon: int | float | None = None,
) -> FixedKLController | AdaptiveKLController:
    """Build a controller from config (``algorithm.kl_ctrl.{type,kl_coef,target_kl,horizon}`` in verl terms)."""
    if type == "fixed":
        return FixedKLController(kl_coef)
    if type == "adaptive":
        if target_kl is None or horizon is None:
            raise ValueError("an adaptive KL controller needs target_kl and horizon")
        return AdaptiveKLController(kl_coef, target_kl, horizon)
    raise ValueError(f"unknown KL controller type {type!r}; expected 'fixed' or 'adaptive'")
