"""Config sections of training: algorithm, optimiser, actor, critic, trainer, preference."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from rlbus.config.sections import Section, _builtin_or_user_code


class KLControlConfig(Section):
    type: Literal["fixed", "adaptive"] = Field(
        "fixed", description="fixed coefficient, or adaptive toward target_kl (verl's kl_ctrl.type)"
    )
    kl_coef: float = Field(
        0.001, ge=0.0, description="KL-in-reward coefficient (the start value when adaptive)"
    )
    target_kl: float = Field(0.1, gt=0.0, description="the KL the adaptive controller steers toward")
    horizon: int = Field(10000, ge=1, description="steps over which the adaptive controller adjusts")


class AlgorithmConfig(Section):
    adv_estimator: str = Field(
        "grpo",
        description="grpo, gae, rloo, reinforce_plus_plus, dr_grpo, or your own as 'pkg.module:function' "
        "(verl's estimator signature; docs/plugins.md)",
    )
    norm_adv_by_std_in_grpo: bool = Field(
        True, description="divide GRPO advantages by the group's reward std (false: Dr. GRPO)"
    )

    @field_validator("adv_estimator")
    @classmethod
    def _known_estimator(cls, value: str) -> str:
        return _builtin_or_user_code(
            value, ("grpo", "gae", "rloo", "reinforce_plus_plus", "dr_grpo"), "advantage estimator"
        )

    gamma: float = Field(1.0, ge=0.0, le=1.0, description="discount factor (GAE, REINFORCE++)")
    lam: float = Field(1.0, ge=0.0, le=1.0, description="GAE lambda")
    use_kl_in_reward: bool = Field(
        False, description="subtract a KL penalty from the token rewards (needs the ref service)"
    )
    kl_penalty: Literal["k1", "k2", "k3", "kl", "abs", "mse", "low_var_kl"] = Field(
        "k1", description="KL estimator of use_kl_in_reward; verl's names (kl, abs, mse, low_var_kl) too"
    )
    kl_ctrl: KLControlConfig = Field(
        default_factory=KLControlConfig, description="the KL-in-reward coefficient and its controller"
    )
    dynamic_sampling: bool = Field(False, description="DAPO: drop groups whose rewards are all equal")
    overlong_buffer_len: int = Field(
        0, ge=0, description="DAPO soft overlong punishment: last N tokens; 0 = off"
    )
    overlong_penalty_factor: float = Field(1.0, ge=0.0, description="DAPO: penalty at max_response_length")


class OptimConfig(Section):
    lr: float = Field(1e-4, gt=0.0, description="peak learning rate")
    weight_decay: float = Field(0.0, ge=0.0, description="AdamW weight decay")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas")
    eps: float = Field(1e-8, gt=0.0, description="Adam epsilon")
    lr_warmup_steps: int = Field(0, ge=-1, description="-1 = lr_warmup_steps_ratio of the total steps (verl)")
    lr_warmup_steps_ratio: float = Field(
        0.0, ge=0.0, le=1.0, description="warmup share when lr_warmup_steps=-1"
    )
    lr_scheduler: Literal["constant", "cosine"] = Field("constant", description="verl: warmup_style")
    min_lr_ratio: float = Field(
        0.0, ge=0.0, le=1.0, description="cosine schedule ends at this fraction of lr"
    )
    grad_clip: float = Field(1.0, gt=0.0, description="global gradient-norm clip")


class ActorConfig(Section):
    optim: OptimConfig = Field(default_factory=OptimConfig, description="the policy's optimiser and schedule")
    ppo_mini_batch_size: int = Field(0, ge=0, description="prompts per optimizer step; 0 = the whole batch")
    ppo_micro_batch_size: int = Field(16, ge=1, description="sequences per forward/backward")
    ppo_epochs: int = Field(
        1,
        ge=1,
        description="passes over each batch (more than one makes the update off-policy within the step)",
    )
    use_torch_compile: bool | None = Field(
        None,
        description="torch.compile each decoder layer of the policy (once, at start); None = on when the "
        "learner is on CUDA, model.use_liger is off and the model has 10M parameters or more",
    )
    master_weights: Literal["auto", "model", "optimizer"] = Field(
        "auto",
        description="with model.dtype bf16/fp16: model = fp32 parameters computing in model.dtype "
        "(autocast on one GPU, FSDP2 mixed precision across ranks); optimizer = the model held in model.dtype, "
        "the fp32 master copy and moments in the optimizer state (one learner rank); auto = optimizer on one "
        "rank, model under FSDP2",
    )
    clip_ratio: float = Field(
        0.2, gt=0.0, description="PPO clip range epsilon (both sides unless clip_ratio_low/high are set)"
    )
    clip_ratio_low: float | None = Field(
        None, description="lower clip range (DAPO's decoupled clip); None = clip_ratio"
    )
    clip_ratio_high: float | None = Field(
        None, description="upper clip range (DAPO's clip-higher); None = clip_ratio"
    )
    clip_ratio_c: float = Field(3.0, gt=1.0, description="dual-clip bound")
    policy_loss: str = Field(
        "vanilla",
        description="vanilla = verl's: PPO clip with the dual clip (clip_ratio_c) on negative "
        "advantages; dual_clip is the same; gspo = sequence-level ratio, seq-mean-token-mean aggregation; "
        "or your own as 'pkg.module:function' (verl's policy-loss signature; docs/plugins.md)",
    )

    @field_validator("policy_loss")
    @classmethod
    def _known_policy_loss(cls, value: str) -> str:
        return _builtin_or_user_code(value, ("vanilla", "dual_clip", "gspo"), "policy loss")

    loss_agg_mode: Literal[
        "token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"
    ] = Field("token-mean", description="how token losses become one number (verl's names)")
    entropy_coeff: float = Field(0.0, description="entropy bonus coefficient")
    use_kl_loss: bool = Field(
        False, description="add a KL-to-reference term to the loss (GRPO's; needs the ref service)"
    )
    kl_loss_coef: float = Field(0.001, ge=0.0, description="coefficient of that KL term")
    kl_loss_type: Literal["k1", "k2", "k3", "kl", "abs", "mse", "low_var_kl"] = Field(
        "low_var_kl", description="KL estimator of that term (k1/k2/k3 = kl/mse/low_var_kl)"
    )
    use_dynamic_bsz: bool = Field(
        False,
        description="token-bounded micro-batches (ppo_max_token_len_per_gpu) instead of ppo_micro_batch_size "
        "sequences; effective with model.use_remove_padding (verl's two keys, two meanings)",
    )
    tis_cap: float = Field(2.0, gt=0.0, description="truncated importance-sampling cap for stale samples")
    ppo_max_token_len_per_gpu: int = Field(
        16384, ge=1, description="token budget of one micro-batch when micro-batches are sized by tokens"
    )
    param_offload: bool = Field(False, description="FSDP2 keeps parameter shards on the CPU")
    optimizer_offload: bool = Field(
        False, description="FSDP2 keeps optimiser state on the CPU (offloads parameters with it)"
    )


class CriticConfig(Section):
    model_path: Path | None = Field(
        None, description="value model checkpoint (PPO with gae); None = the policy's"
    )
    optim: OptimConfig = Field(
        default_factory=lambda: OptimConfig(lr=1e-4), description="the critic's optimiser and schedule"
    )
    cliprange_value: float = Field(0.5, gt=0.0, description="clip range of the value prediction")
    value_loss_coef: float = Field(0.5, ge=0.0, description="weight of the value loss")


LoggerName = Literal["console", "jsonl", "tensorboard", "wandb"]
DEFAULT_LOGGERS: tuple[LoggerName, ...] = ("console", "jsonl", "tensorboard")


class TrainerConfig(Section):
    total_epochs: int = Field(
        1, ge=1, description="passes over the training prompts (capped by total_training_steps)"
    )
    total_training_steps: int | None = Field(
        150, ge=1, description="stops earlier than total_epochs when set"
    )
    async_level: int = Field(
        1, ge=0, description="policy versions rollouts may lag behind; 0 = on-policy sync"
    )
    save_freq: int = Field(-1, description="checkpoint every N steps; -1 = never")
    test_freq: int = Field(25, description="validate (greedy, held-out split) every N steps; -1 = never")
    val_before_train: bool = Field(True, description="validate the starting policy before step 1")
    val_only: bool = Field(
        False, description="verl: validate the starting policy once, then stop (no training)"
    )
    logger: list[Literal["console", "jsonl", "tensorboard", "wandb"]] = Field(
        default_factory=lambda: list(DEFAULT_LOGGERS), description="one name or a list"
    )
    project_name: str = Field("rlbus", description="project name for wandb/tensorboard")
    experiment_name: str = Field("demo", description="experiment name; names the run when run.id is not set")
    nnodes: int = Field(1, ge=1, description="nodes of a torchrun learner")
    n_gpus_per_node: int = Field(0, ge=0, description="0 = CPU")
    resume_mode: str = Field(
        "auto", description="auto | disable | resume_path (with resume_from_path) | <path>"
    )
    resume_from_path: str | None = Field(
        None, description="the checkpoint to resume (verl); implies resume_path"
    )
    default_local_dir: Path | None = Field(
        None, description="checkpoint folder; None = <run dir>/checkpoints (the run dir is per experiment)"
    )
    critic_warmup: int = Field(0, ge=0, description="verl: steps that train only the critic; 0 only here")
    max_ckpt_to_keep: int = Field(3, ge=1, description="checkpoints kept; older ones are deleted")
    rolling_checkpoint_budget: float = Field(
        0.05,
        ge=0,
        le=1,
        description="a rolling checkpoint of the newest step, staged to host memory and written in the "
        "background, so a learner restart retrains about one step: it stages whenever its cost stays within "
        "this fraction of a step's time (0 = off; one learner process only; save_freq's are the kept ones)",
    )
    memory_checkpoint: Literal["auto", "on", "off"] = Field(
        "auto",
        description="every step's model and optimizer state also copied to shared memory (two slots in "
        "memory_checkpoint_dir, on a side stream beside the next step), so a killed learner process resumes "
        "from its last step or the one before; auto = on for one learner process on a GPU, when two copies "
        "fit in the folder's filesystem",
    )
    memory_checkpoint_dir: Path = Field(
        Path("/dev/shm"), description="tmpfs folder of the memory checkpoint (a folder per run is made in it)"
    )
    seed: int = Field(0, description="seed of model initialisation and training")
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="where the learner trains: auto picks a GPU when there is one"
    )
    batch_timeout_s: float = Field(
        300.0, gt=0, description="longest wait for ready trajectories before giving up"
    )
    weight_push_timeout_s: float = Field(
        60.0,
        gt=0,
        description="seconds a weight push may take; the learner announces it with each push, so a replica "
        "waits inside the push exactly as long",
    )
    weight_bucket_mb: int = Field(64, ge=1, description="size of one weight-push bucket")
    weight_sync_backend: Literal["auto", "cuda_ipc", "nccl", "gloo"] = Field(
        "auto",
        description="weight push transport per replica; auto = CUDA IPC on the learner's own GPU, NCCL "
        "to other GPUs, gloo (through host memory) for CPU or mixed placements",
    )
    weight_push_max_failures: int = Field(
        5, ge=1, description="pushes failing in a row for the same reason before the run stops with it"
    )
    weight_sync_host: str | None = Field(None, description="address replicas dial for the weight group")
    replica_timeout_s: float = Field(20.0, gt=0, description="a replica silent this long is dropped")
    weight_join_window_s: float = Field(
        0.5,
        gt=0,
        description="how long the learner's roll call before a new weight group waits for replicas to answer; "
        "only replicas that answer join (a heartbeat alone is not enough), so a dead or forged replica costs "
        "at most this, not a rendezvous timeout",
    )
    rollout_data_dir: str | None = Field(
        None,
        description="write every trained sample of step N to <dir>/N.jsonl (verl's key; relative to the cwd)",
    )

    @field_validator("memory_checkpoint", mode="before")
    @classmethod
    def _on_off_words(cls, value: object) -> object:
        """`on`/`off` on a command line read as YAML booleans."""
        return {True: "on", False: "off"}.get(value, value) if isinstance(value, bool) else value

    @field_validator("logger", mode="before")
    @classmethod
    def _logger_list(cls, value: object) -> object:
        return [value] if isinstance(value, str) else value

    @model_validator(mode="after")
    def _resume_path(self) -> TrainerConfig:
        if self.resume_from_path and self.resume_mode in ("auto", "resume_path"):
            self.__dict__["resume_mode"] = str(self.resume_from_path)
        elif self.resume_mode == "resume_path":
            raise ValueError("trainer.resume_mode=resume_path needs trainer.resume_from_path")
        return self


class PreferenceConfig(Section):
    """Offline preference training (`rlbus train` with algorithm != none): DPO, KTO or SimPO on fixed pairs.

    The policy is `model.path` (None = the bundled tiny model); the frozen reference is `ref.model_path`
    or the policy's initial weights. With no `train_files`, a synthetic set is made from `data.task`.
    """

    algorithm: Literal["none", "dpo", "kto", "simpo"] = Field("none", description="none = RL (services)")
    train_files: list[Path] = Field(default_factory=list, description="JSONL/parquet; [] = synthetic")
    val_files: list[Path] = Field(default_factory=list, description="held-out; [] = eval_fraction of train")
    eval_fraction: float = Field(0.1, ge=0.0, lt=1.0, description="train share held out without val_files")
    synthetic_train_examples: int = Field(256, ge=1, description="pairs generated when train_files is empty")
    synthetic_val_examples: int = Field(
        64, ge=1, description="held-out pairs made from data.task when there are no val_files"
    )
    prompt_key: str = Field("prompt", description="row key of the prompt")
    chosen_key: str = Field("chosen", description="row key of the preferred completion")
    rejected_key: str = Field("rejected", description="row key of the dispreferred completion")
    completion_key: str = Field("completion", description="KTO unpaired rows: prompt/completion/label")
    label_key: str = Field(
        "label", description="row key of KTO's desirable (true) / undesirable (false) label"
    )
    loss_type: Literal["sigmoid", "ipo", "hinge"] = Field("sigmoid", description="DPO variant")
    beta: float | None = Field(None, gt=0.0, description="None = 0.1 for DPO/KTO, 2.0 for SimPO")
    label_smoothing: float = Field(0.0, ge=0.0, lt=0.5, description="conservative DPO / SimPO")
    simpo_gamma: float = Field(0.5, ge=0.0, description="SimPO target reward margin")
    kto_desirable_weight: float = Field(1.0, ge=0.0, description="KTO weight of desirable examples")
    kto_undesirable_weight: float = Field(1.0, ge=0.0, description="KTO weight of undesirable examples")
    epochs: int = Field(1, ge=1, description="passes over the training pairs")
    max_steps: int | None = Field(None, ge=1, description="stops earlier than epochs when set")
    batch_size: int = Field(16, ge=1, description="pairs (KTO: examples) per optimizer step")
    micro_batch_size: int = Field(8, ge=1, description="pairs per forward/backward (gradient accumulation)")
    eval_batch_size: int = Field(32, ge=1, description="pairs per held-out forward pass")
    lr: float = Field(1e-6, gt=0.0, description="learning rate (AdamW)")
    weight_decay: float = Field(0.0, ge=0.0, description="AdamW weight decay")
    lr_warmup_steps: int = Field(0, ge=0, description="linear warmup steps, then constant")
    grad_clip: float = Field(1.0, gt=0.0, description="global gradient-norm clip")
    max_length: int = Field(512, ge=2, description="prompt + completion tokens; longer rows are truncated")
    max_prompt_length: int | None = Field(None, ge=1, description="prompt tokens kept (its end); None = all")
    append_eos: bool = Field(True, description="end every completion with the tokenizer's eos token")
    ref_source: Literal["local", "service"] = Field("local", description="ref log-probs: here or ref service")
    ref_timeout_s: float = Field(300.0, gt=0, description="ref_source=service: longest wait for its answers")
    log_every: int = Field(1, ge=1, description="console line every N steps")
    save_model: bool = Field(True, description="write the trained model to <run dir>/model")
    seed: int = Field(0, description="seed of data order, splits and synthetic pairs")
