"""Config sections of the services and the bus: run, data, model, rollout, reward, ref, bus, logging."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


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
