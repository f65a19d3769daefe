"""Pure RL math for the learner: advantage estimators, policy/value losses, KL, preference losses, DAPO.

No I/O and no service code here (design rule 1): every public name is a function of tensors or a tiny
controller object, unit tested against hand-computed cases.
"""

from .advantages import (
    ESTIMATORS,
    compute_advantages,
    dr_grpo_advantages,
    gae_advantages,
    grpo_advantages,
    masked_mean,
    masked_whiten,
    reinforce_plus_plus_advantages,
    rloo_advantages,
    sequence_to_token_rewards,
)
from .dapo import overlong_penalty
from .kl import KL_KINDS, AdaptiveKLController, FixedKLController, build_kl_controller, kl_estimate
from .policy_loss import (
    LOSS_AGG_MODES,
    aggregate_loss,
    gspo_loss,
    ppo_clip_loss,
    truncated_is_weights,
)
from .preference import DPO_LOSS_TYPES, dpo_loss, kto_loss, sequence_logps, simpo_loss
from .value_loss import clipped_value_loss

__all__ = [
    "DPO_LOSS_TYPES",
    "ESTIMATORS",
    "KL_KINDS",
    "LOSS_AGG_MODES",
    "AdaptiveKLController",
    "FixedKLController",
    "aggregate_loss",
    "build_kl_controller",
    "clipped_value_loss",
    "compute_advantages",
    "dpo_loss",
    "dr_grpo_advantages",
    "gae_advantages",
    "grpo_advantages",
    "gspo_loss",
    "kl_estimate",
    "kto_loss",
    "masked_mean",
    "masked_whiten",
    "overlong_penalty",
    "ppo_clip_loss",
    "reinforce_plus_plus_advantages",
    "rloo_advantages",
    "sequence_logps",
    "sequence_to_token_rewards",
    "simpo_loss",
    "truncated_is_weights",
]
