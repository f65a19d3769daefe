"""The one typed config tree every service reads. Field names follow verl where the meaning is the same."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from rlbus.config.yaml_layer import YamlLayerSource


def _builtin_or_user_code(value: str, builtins: tuple[str, ...], what: str) -> str:
    """A built-in name, or user code by import path that loads now: a typo fails at start-up, not at step 1."""
    from rlbus.plugins import is_import_path, load_callable

    if is_import_path(value):
        load_callable(value, what)  # ValueError -> pydantic names the key
        return value
    if value not in builtins:
        raise ValueError(
            f"unknown {what} {value!r}; expected one of {', '.join(builtins)} or 'pkg.module:function'"
        )
    return value


class Section(BaseModel):
    """Unknown keys are errors: a typo must never be silently ignored."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class RunConfig(Section):
    id: str = Field(
        "demo", pattern=r"^[A-Za-z0-9_-]+$", description="namespaces every subject, stream and bucket"
    )
    dir: Path = Field(
        Path("runs"), description="parent folder of run directories (logs, metrics, checkpoints)"
    )
    health_port: int = Field(0, ge=0, description="HTTP port for /healthz, /readyz, /metrics; 0 = off")
    max_restarts: int = Field(
        5,
        ge=0,
        description="`rlbus up` restarts a service that dies this many times "
        "(the learner resumes from its last checkpoint), then stops the run",
    )
    restart_backoff_s: float = Field(
        1.0, ge=0.0, description="wait before a restart; doubles per restart, at most 30 s"
    )


class DataConfig(Section):
    task: Literal["addition", "countdown", "jsonl"] = Field(
        "addition",
        description="a synthetic task, or jsonl = the rows of train_files/val_files (JSONL or parquet, "
        "verl's schema included); jsonl is implied when train_files is given",
    )
    train_files: list[Path] = Field(
        default_factory=list, description="JSONL/parquet files: one path or a list"
    )
    val_files: list[Path] = Field(default_factory=list, description="held-out files: one path or a list")
    prompt_key: str = "prompt"
    answer_key: str = "answer"
    train_batch_size: int = Field(16, ge=1, description="prompts per learner step")
    val_batch_size: int = Field(64, ge=1)
    num_train_examples: int = Field(20000, ge=1, description="size of a generated synthetic train split")
    num_val_examples: int = Field(128, ge=1)
    max_prompt_length: int = Field(64, ge=1)
    max_response_length: int = Field(8, ge=1)
    shuffle: bool = True
    seed: int = 0
    task_digits: int = Field(2, ge=1, le=6, description="operand digits of the synthetic tasks")
    truncation: Literal["error", "left", "right", "middle"] = Field(
        "error",
        description="a prompt over max_prompt_length: refuse the run at start (verl's default), or keep "
        "its end (left), its start (right), or both ends (middle)",
    )
    filter_overlong_prompts: bool = Field(
        False, description="drop rows whose prompt is over max_prompt_length"
    )

    @field_validator("train_files", "val_files", mode="before")
    @classmethod
    def _one_or_many(cls, value: object) -> object:
        """verl's scripts pass one path (`data.train_files=$HOME/data/gsm8k/train.parquet`) or a list."""
        return [value] if isinstance(value, str | Path) else value

    @model_validator(mode="after")
    def _files_mean_files(self) -> DataConfig:
        if self.train_files and self.task != "jsonl":
            if "task" in self.model_fields_set:
                raise ValueError(
                    f"data.train_files is set but data.task={self.task} makes its own synthetic data: drop "
                    "data.task (the files are then used) or drop data.train_files"
                )
            self.__dict__["task"] = "jsonl"  # the files are the data: never a silent synthetic fallback
        return self


class ModelConfig(Section):
    path: Path | None = Field(None, description="HF checkpoint directory; None = the bundled tiny model")
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    enable_gradient_checkpointing: bool = False
    use_remove_padding: bool = False
    lora_rank: int = Field(0, ge=0)
    lora_alpha: int = Field(16, ge=1)
    target_modules: list[str] | str = "all-linear"
    trust_remote_code: bool = False
    use_shm: bool = Field(
        False, description="copy the model directory to /dev/shm once per host and load it from there"
    )
    use_fused_kernels: bool = Field(
        True,
        description="log-probs and entropies from chunks of the output projection (never full-vocabulary "
        "fp32 logits); false = the plain full-logits path",
    )
    logprob_chunk_tokens: int = Field(1024, ge=1, description="tokens per chunk of the fused log-prob path")
    use_liger: bool = Field(
        False,
        description="Liger's Triton kernels for RMSNorm, SwiGLU and RoPE in the learner "
        "(CUDA; needs liger-kernel)",
    )

    @property
    def logprob_chunk(self) -> int:
        """What `token_logprobs` takes: the chunk size, or 0 for full logits."""
        return self.logprob_chunk_tokens if self.use_fused_kernels else 0


class RolloutConfig(Section):
    name: Literal["hf", "vllm", "sglang"] = "hf"
    n: int = Field(8, ge=1, description="samples per prompt (the GRPO group size)")
    temperature: float = Field(0.7, ge=0.0, description="0.7 suits the bundled tiny model; verl uses 1.0")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1, description="-1 = off")
    stop: list[str] = Field(default_factory=list)
    ignore_eos: bool = Field(
        False, description="generate max_response_length tokens past end tokens (benchmarks)"
    )
    prompts_per_batch: int = Field(8, ge=1, description="prompt work items a replica generates together")
    replicas: int = Field(1, ge=1, description="rollout processes `rlbus up` starts")
    seed: int = 0
    seed_per_prompt: bool = Field(
        False,
        description="seed each prompt's sampling from (seed, data index): the same samples whoever "
        "generates it and whenever (reproducible runs and resumes); slower, seeded requests run alone",
    )
    tensor_model_parallel_size: int = Field(1, ge=1)
    gpu_memory_utilization: float = Field(
        0.5,
        gt=0.0,
        le=1.0,
        description="share of the GPU this replica may take (vllm/sglang: their KV sizing; "
        "hf: a cap on the process's allocations), leaving the rest to a learner on the same GPU",
    )
    max_num_seqs: int = Field(256, ge=1)
    enforce_eager: bool | None = Field(
        None,
        description="no compiled/CUDA-graph decode; None = the engine's choice (eager on CPU, compiled "
        "decode on GPU: vLLM's CUDA graphs, the hf engine's static KV cache)",
    )
    enable_prefix_caching: bool = True
    sglang_url: str | None = None
    device: Literal["auto", "cpu", "cuda"] = "auto"
    weight_wait_timeout_s: float | None = Field(
        None,
        gt=0,
        description="how long work waits for its min policy version; None = half of "
        "trainer.batch_timeout_s (it must stay below it, or a replica holding work could outwait the learner)",
    )


class RewardConfig(Section):
    type: Literal["task", "function", "http", "model"] = Field(
        "task",
        description="task = the built-in verifier of each row's data_source / task; model = a reward "
        "model (reward_model.enable)",
    )
    manager: Literal["naive", "batch"] = Field(
        "naive",
        description="verl's reward_model.reward_manager: naive calls the function once per response; "
        "batch once per fetched batch with lists (data_sources, solution_strs, ground_truths, extra_infos)",
    )
    function: str | None = Field(
        None, description="'pkg.module:callable' or '/path/file.py:callable' when type=function"
    )
    signature: Literal["auto", "rlbus", "verl"] = Field(
        "auto",
        description="rlbus: fn(prompt, response, meta); verl: compute_score(data_source, solution_str, "
        "ground_truth, extra_info); auto: verl when the first parameter is named data_source",
    )
    http_url: str | None = None
    on_error_score: float = 0.0
    timeout_s: float = Field(10.0, gt=0)
    memory_limit_mb: int = Field(1024, ge=16)

    @model_validator(mode="after")
    def _needs_target(self) -> RewardConfig:
        if self.type == "function" and not self.function:
            raise ValueError("reward.function is required when reward.type=function ('pkg.mod:fn')")
        if self.type == "http" and not self.http_url:
            raise ValueError("reward.http_url is required when reward.type=http")
        return self


class RewardModelConfig(Section):
    """verl's `reward_model.*`: a sequence-classification model scores prompt + response (one logit);
    with `enable` it is the reward (reward.type=model), as in verl where its score replaces the rule's."""

    enable: bool = False
    model_path: Path | None = Field(None, description="HF sequence-classification checkpoint (num_labels=1)")
    micro_batch_size: int = Field(16, ge=1, description="responses per forward pass")
    max_length: int | None = Field(None, ge=1, description="truncate prompt + response to this many tokens")
    device: str = Field("auto", description="auto = the reward process's GPU if it has one, else CPU")
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    correct_threshold: float = Field(0.0, description="a score above this counts as correct (metrics only)")

    @model_validator(mode="after")
    def _needs_model(self) -> RewardModelConfig:
        if self.enable and self.model_path is None:
            raise ValueError("reward_model.model.path is required when reward_model.enable=true")
        return self


class CustomRewardFunctionConfig(Section):
    """verl's `custom_reward_function.path/name`: a file with compute_score(data_source, solution_str,
    ground_truth, extra_info); it becomes reward.type=function with verl's signature."""

    path: Path | None = None
    name: str = "compute_score"


class RefConfig(Section):
    micro_batch_size: int = Field(16, ge=1)
    model_path: Path | None = Field(None, description="None = the policy's initial weights")


class KLControlConfig(Section):
    type: Literal["fixed", "adaptive"] = "fixed"
    kl_coef: float = Field(0.001, ge=0.0)
    target_kl: float = Field(0.1, gt=0.0)
    horizon: int = Field(10000, ge=1)


class AlgorithmConfig(Section):
    adv_estimator: str = Field(
        "grpo",
        description="grpo, gae, rloo, reinforce_plus_plus, dr_grpo, or your own as 'pkg.module:function' "
        "(verl's estimator signature; docs/plugins.md)",
    )
    norm_adv_by_std_in_grpo: bool = True

    @field_validator("adv_estimator")
    @classmethod
    def _known_estimator(cls, value: str) -> str:
        return _builtin_or_user_code(
            value, ("grpo", "gae", "rloo", "reinforce_plus_plus", "dr_grpo"), "advantage estimator"
        )

    gamma: float = Field(1.0, ge=0.0, le=1.0)
    lam: float = Field(1.0, ge=0.0, le=1.0)
    use_kl_in_reward: bool = False
    kl_penalty: Literal["k1", "k2", "k3", "kl", "abs", "mse", "low_var_kl"] = Field(
        "k1", description="KL estimator of use_kl_in_reward; verl's names (kl, abs, mse, low_var_kl) too"
    )
    kl_ctrl: KLControlConfig = Field(default_factory=KLControlConfig)
    dynamic_sampling: bool = Field(False, description="DAPO: drop groups whose rewards are all equal")
    overlong_buffer_len: int = Field(
        0, ge=0, description="DAPO soft overlong punishment: last N tokens; 0 = off"
    )
    overlong_penalty_factor: float = Field(1.0, ge=0.0, description="DAPO: penalty at max_response_length")


class OptimConfig(Section):
    lr: float = Field(1e-4, gt=0.0)
    weight_decay: float = Field(0.0, ge=0.0)
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = Field(1e-8, gt=0.0, description="Adam epsilon")
    lr_warmup_steps: int = Field(0, ge=-1, description="-1 = lr_warmup_steps_ratio of the total steps (verl)")
    lr_warmup_steps_ratio: float = Field(
        0.0, ge=0.0, le=1.0, description="warmup share when lr_warmup_steps=-1"
    )
    lr_scheduler: Literal["constant", "cosine"] = Field("constant", description="verl: warmup_style")
    min_lr_ratio: float = Field(0.0, ge=0.0, le=1.0)
    grad_clip: float = Field(1.0, gt=0.0)


class ActorConfig(Section):
    optim: OptimConfig = Field(default_factory=OptimConfig)
    ppo_mini_batch_size: int = Field(0, ge=0, description="prompts per optimizer step; 0 = the whole batch")
    ppo_micro_batch_size: int = Field(16, ge=1, description="sequences per forward/backward")
    ppo_epochs: int = Field(1, ge=1)
    use_torch_compile: bool | None = Field(
        None,
        description="torch.compile each decoder layer of the policy; None = on when the learner is on CUDA",
    )
    master_weights: Literal["auto", "model", "optimizer"] = Field(
        "auto",
        description="with model.dtype bf16/fp16: model = fp32 parameters computing in model.dtype "
        "(autocast on one GPU, FSDP2 mixed precision across ranks); optimizer = the model held in model.dtype, "
        "the fp32 master copy and moments in the optimizer state (one learner rank); auto = optimizer on one "
        "rank, model under FSDP2",
    )
    clip_ratio: float = Field(0.2, gt=0.0)
    clip_ratio_low: float | None = None
    clip_ratio_high: float | None = None
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
    ] = "token-mean"
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = Field(0.001, ge=0.0)
    kl_loss_type: Literal["k1", "k2", "k3", "kl", "abs", "mse", "low_var_kl"] = "low_var_kl"
    use_dynamic_bsz: bool = Field(
        False,
        description="token-bounded micro-batches (ppo_max_token_len_per_gpu); "
        "effective with model.use_remove_padding",
    )
    tis_cap: float = Field(2.0, gt=0.0, description="truncated importance-sampling cap for stale samples")
    ppo_max_token_len_per_gpu: int = Field(16384, ge=1)
    param_offload: bool = False
    optimizer_offload: bool = False


class CriticConfig(Section):
    model_path: Path | None = None
    optim: OptimConfig = Field(default_factory=lambda: OptimConfig(lr=1e-4))
    cliprange_value: float = Field(0.5, gt=0.0)
    value_loss_coef: float = Field(0.5, ge=0.0)


class TrainerConfig(Section):
    total_epochs: int = Field(1, ge=1)
    total_training_steps: int | None = Field(
        150, ge=1, description="stops earlier than total_epochs when set"
    )
    async_level: int = Field(
        1, ge=0, description="policy versions rollouts may lag behind; 0 = on-policy sync"
    )
    save_freq: int = Field(-1, description="checkpoint every N steps; -1 = never")
    test_freq: int = Field(25, description="validate (greedy, held-out split) every N steps; -1 = never")
    val_before_train: bool = True
    val_only: bool = Field(
        False, description="verl: validate the starting policy once, then stop (no training)"
    )
    logger: list[Literal["console", "jsonl", "tensorboard", "wandb"]] = Field(
        default_factory=lambda: ["console", "jsonl", "tensorboard"], description="one name or a list"
    )
    project_name: str = "rlbus"
    experiment_name: str = "demo"
    nnodes: int = Field(1, ge=1)
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
    max_ckpt_to_keep: int = Field(3, ge=1)
    seed: int = 0
    device: Literal["auto", "cpu", "cuda"] = "auto"
    batch_timeout_s: float = Field(
        300.0, gt=0, description="longest wait for ready trajectories before giving up"
    )
    weight_push_timeout_s: float = Field(60.0, gt=0)
    weight_bucket_mb: int = Field(64, ge=1)
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
    rollout_data_dir: str | None = Field(
        None,
        description="write every trained sample of step N to <dir>/N.jsonl (verl's key; relative to the cwd)",
    )

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


class BusConfig(Section):
    url: str | None = Field(
        None, description="nats:// URL; None = use 127.0.0.1:4222 if it answers, else start one"
    )
    local_port: int = Field(0, ge=0, description="port for a server rlbus starts itself; 0 = pick a free one")
    ack_wait_s: float = Field(60.0, gt=0)
    max_deliver: int = Field(5, ge=1)
    max_payload_bytes: int = Field(
        8 * 1024 * 1024, ge=1024, description="max_payload for a server rlbus starts"
    )
    user: str | None = None
    password: str | None = None
    token: str | None = None
    creds_file: Path | None = None
    nkeys_seed: Path | None = None
    tls_ca: Path | None = None
    tls_cert: Path | None = None
    tls_key: Path | None = None
    connect_timeout_s: float = Field(5.0, gt=0)
    storage: Literal["file", "memory"] = "file"


class LoggingConfig(Section):
    level: Literal["debug", "info", "warning", "error"] = "info"
    json_logs: bool = False


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
    synthetic_val_examples: int = Field(64, ge=1)
    prompt_key: str = "prompt"
    chosen_key: str = "chosen"
    rejected_key: str = "rejected"
    completion_key: str = Field("completion", description="KTO unpaired rows: prompt/completion/label")
    label_key: str = "label"
    loss_type: Literal["sigmoid", "ipo", "hinge"] = Field("sigmoid", description="DPO variant")
    beta: float | None = Field(None, gt=0.0, description="None = 0.1 for DPO/KTO, 2.0 for SimPO")
    label_smoothing: float = Field(0.0, ge=0.0, lt=0.5, description="conservative DPO / SimPO")
    simpo_gamma: float = Field(0.5, ge=0.0, description="SimPO target reward margin")
    kto_desirable_weight: float = Field(1.0, ge=0.0)
    kto_undesirable_weight: float = Field(1.0, ge=0.0)
    epochs: int = Field(1, ge=1)
    max_steps: int | None = Field(None, ge=1, description="stops earlier than epochs when set")
    batch_size: int = Field(16, ge=1, description="pairs (KTO: examples) per optimizer step")
    micro_batch_size: int = Field(8, ge=1, description="pairs per forward/backward (gradient accumulation)")
    eval_batch_size: int = Field(32, ge=1)
    lr: float = Field(1e-6, gt=0.0)
    weight_decay: float = Field(0.0, ge=0.0)
    lr_warmup_steps: int = Field(0, ge=0)
    grad_clip: float = Field(1.0, gt=0.0)
    max_length: int = Field(512, ge=2, description="prompt + completion tokens; longer rows are truncated")
    max_prompt_length: int | None = Field(None, ge=1, description="prompt tokens kept (its end); None = all")
    append_eos: bool = Field(True, description="end every completion with the tokenizer's eos token")
    ref_source: Literal["local", "service"] = Field("local", description="ref log-probs: here or ref service")
    ref_timeout_s: float = Field(300.0, gt=0, description="ref_source=service: longest wait for its answers")
    log_every: int = Field(1, ge=1)
    save_model: bool = True
    seed: int = 0


class RlbusConfig(BaseSettings):
    """Root of the tree. Sources, strongest first: command-line overrides, RLBUS_* env vars, the YAML file."""

    model_config = SettingsConfigDict(
        env_prefix="RLBUS_", env_nested_delimiter="__", extra="forbid", validate_assignment=True
    )

    run: RunConfig = Field(default_factory=RunConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    custom_reward_function: CustomRewardFunctionConfig = Field(default_factory=CustomRewardFunctionConfig)
    reward_model: RewardModelConfig = Field(default_factory=RewardModelConfig)
    ref: RefConfig = Field(default_factory=RefConfig)
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    actor: ActorConfig = Field(default_factory=ActorConfig)
    critic: CriticConfig = Field(default_factory=CriticConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    bus: BusConfig = Field(default_factory=BusConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    preference: PreferenceConfig = Field(default_factory=PreferenceConfig)
    _inert_keys: dict[str, str] = PrivateAttr(default_factory=dict)

    @property
    def inert_keys(self) -> dict[str, str]:
        """verl keys the loader accepted without effect here -> why (each a start-up warning)."""
        return self._inert_keys

    @model_validator(mode="after")
    def _run_per_experiment(self) -> RlbusConfig:
        """verl keys checkpoints by experiment: a new trainer.experiment_name is a new run (streams, run dir,
        checkpoints), never a resume of another experiment's state. An explicit run.id wins."""
        if "id" not in self.run.model_fields_set and "experiment_name" in self.trainer.model_fields_set:
            run_id = re.sub(r"[^A-Za-z0-9_-]+", "-", self.trainer.experiment_name).strip("-") or "demo"
            if run_id != self.run.id:
                self.__dict__["run"] = self.run.model_copy(update={"id": run_id})
        return self

    @model_validator(mode="after")
    def _verl_reward_function(self) -> RlbusConfig:
        crf = self.custom_reward_function
        if crf.path is not None:
            spec = f"{crf.path}:{crf.name}"
            if self.reward.type == "http":
                raise ValueError(
                    "custom_reward_function.path and reward.type=http both name the reward: keep one"
                )
            if self.reward.function not in (None, spec):
                raise ValueError(
                    f"custom_reward_function.path and reward.function={self.reward.function} both name "
                    "the reward function: keep one"
                )
            if self.reward.function != spec or self.reward.type != "function":
                self.__dict__["reward"] = self.reward.model_copy(
                    update={
                        "type": "function",
                        "function": spec,
                        "signature": "verl" if self.reward.signature == "auto" else self.reward.signature,
                    }
                )
        return self

    @model_validator(mode="after")
    def _verl_reward_model(self) -> RlbusConfig:
        if self.reward_model.enable and self.reward.type != "model":
            if "type" in self.reward.model_fields_set or self.custom_reward_function.path is not None:
                raise ValueError(
                    f"reward_model.enable=true and reward.type={self.reward.type} both name the reward: keep one"
                )
            self.__dict__["reward"] = self.reward.model_copy(update={"type": "model"})
        if self.reward.type == "model" and not self.reward_model.enable:
            raise ValueError("reward.type=model needs reward_model.enable=true and reward_model.model.path")
        return self

    @model_validator(mode="after")
    def _waits_nest(self) -> RlbusConfig:
        """A replica holding work for a version gives it back before the learner gives up on data."""
        wait = self.rollout.weight_wait_timeout_s
        if wait is not None and wait >= self.trainer.batch_timeout_s:
            raise ValueError(
                f"rollout.weight_wait_timeout_s={wait:g} must be below trainer.batch_timeout_s="
                f"{self.trainer.batch_timeout_s:g}: a replica holding work would make the learner stall first"
            )
        return self

    @property
    def weight_wait_s(self) -> float:
        """How long a replica holds work waiting for its weights (rollout.weight_wait_timeout_s resolved)."""
        wait = self.rollout.weight_wait_timeout_s
        return wait if wait is not None else self.trainer.batch_timeout_s / 2

    @property
    def needs_ref(self) -> bool:
        """The ref service runs only when some KL term needs reference log-probs."""
        return self.actor.use_kl_loss or self.algorithm.use_kl_in_reward

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return init_settings, env_settings, YamlLayerSource(settings_cls)
