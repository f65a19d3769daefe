"""Keys accepted but inert in the resolved configuration: each becomes a start-up warning naming the key.

A verl user's keys must mean what they meant in verl; where one has no effect here (or rlbus keeps another
default that the user's other keys show they do not expect), saying so at start-up is the difference
between a surprise and a silent wrong run.
"""

from __future__ import annotations

from rlbus.config.schema import RlbusConfig


def _set(section: object, name: str) -> bool:
    return name in getattr(section, "model_fields_set", set())


def inert_key_warnings(cfg: RlbusConfig) -> list[str]:
    """One sentence per key that has no effect as configured (pure: the config in, messages out)."""
    out: list[str] = [f"{key} has no effect here: {why}" for key, why in cfg.inert_keys.items()]
    actor, algo = cfg.actor, cfg.algorithm
    if (
        actor.policy_loss == "gspo"
        and _set(actor, "loss_agg_mode")
        and actor.loss_agg_mode != "seq-mean-token-mean"
    ):
        out.append(
            f"actor.loss_agg_mode={actor.loss_agg_mode} has no effect with actor.policy_loss=gspo: GSPO "
            "aggregates seq-mean-token-mean (as verl does)"
        )
    if actor.policy_loss == "gspo" and _set(actor, "clip_ratio_c"):
        out.append(
            "actor.clip_ratio_c has no effect with actor.policy_loss=gspo (no dual clip on sequence ratios)"
        )
    critic_keys = sorted(k for k in cfg.critic.model_fields_set)
    if critic_keys and algo.adv_estimator != "gae":
        out.append(
            f"critic.{critic_keys[0]} (and the other critic.* keys) have no effect: "
            f"algorithm.adv_estimator={algo.adv_estimator} uses no critic; verl's default estimator is "
            "gae (PPO with a critic): set algorithm.adv_estimator=gae for that"
        )
    trainer = cfg.trainer
    if _set(trainer, "total_epochs") and trainer.total_training_steps is not None:
        how = "set by you" if _set(trainer, "total_training_steps") else "rlbus's default"
        out.append(
            f"trainer.total_epochs={trainer.total_epochs} may be cut short by trainer.total_training_steps="
            f"{trainer.total_training_steps} ({how}); set trainer.total_training_steps=null to train "
            "every epoch"
        )
    if cfg.rollout.name == "hf" and cfg.rollout.tensor_model_parallel_size > 1:
        out.append(
            "rollout.tensor_model_parallel_size has no effect with rollout.name=hf (one device per replica)"
        )
    if cfg.rollout.name not in ("vllm", "sglang") and _set(cfg.rollout, "enable_prefix_caching"):
        out.append("rollout.enable_prefix_caching has no effect with rollout.name=hf")
    if cfg.rollout.name != "hf" and cfg.rollout.decode_small_bucket:
        out.append(f"rollout.decode_small_bucket has no effect with rollout.name={cfg.rollout.name}")
    if cfg.rollout.name != "hf" and cfg.rollout.decode_step != "inductor":
        out.append(f"rollout.decode_step has no effect with rollout.name={cfg.rollout.name}")
    elif cfg.rollout.enforce_eager and cfg.rollout.decode_step != "inductor":
        out.append("rollout.decode_step has no effect with rollout.enforce_eager=true (no CUDA graphs)")
    for key in ("mps_learner_sm_percent", "mps_rollout_sm_percent"):
        if getattr(cfg.run, key) != 100 and cfg.run.gpu_sharing == "time_slice":
            out.append(f"run.{key} has no effect with run.gpu_sharing=time_slice (it shares SMs under MPS)")
    if trainer.critic_warmup:
        out.append(
            f"trainer.critic_warmup={trainer.critic_warmup} has no effect: the critic and the actor "
            "train from the first step"
        )
    if _set(cfg.data, "val_batch_size"):
        out.append("data.val_batch_size has no effect: every held-out row is validated (as verl does)")
    if actor.use_dynamic_bsz and not cfg.model.use_remove_padding:
        out.append(
            "actor.use_dynamic_bsz has no effect without model.use_remove_padding=true (token-bounded "
            "micro-batches need packing)"
        )
    rm_keys = sorted(k for k in cfg.reward_model.model_fields_set if k != "enable")
    if rm_keys and not cfg.reward_model.enable:
        out.append(
            f"reward_model.{rm_keys[0]} (and the other reward_model.* keys) have no effect without "
            "reward_model.enable=true"
        )
    if cfg.reward.manager == "batch" and cfg.reward.type != "function":
        out.append(f"reward.manager=batch has no effect with reward.type={cfg.reward.type} (a function only)")
    if trainer.nnodes > 1:
        out.append(
            f"trainer.nnodes={trainer.nnodes}: `rlbus up` runs on this host only (its learner is a "
            f"torchrun job of trainer.n_gpus_per_node={trainer.n_gpus_per_node} ranks); for several nodes "
            "use slurm/rlbus.sbatch or k8s/"
        )
    return out
