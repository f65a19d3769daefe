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


GpuSharing = Literal["auto", "mps", "time_slice"]  # run.gpu_sharing (rlbus.gpu_sharing)


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
        0.1,
        ge=0.0,
        description="wait before a restart; doubles while a service keeps dying within 10 s of its start "
        "(at most 30 s), and is this again once it ran 10 s (Docker's rule)",
    )
    service_start: Literal["fork", "exec"] = Field(
        "fork",
        description="how `rlbus up` starts its services: fork = from one process that already imported "
        "torch and transformers (a start or restart skips 2-4 s of imports); exec = a fresh "
        "`python -m rlbus.cli` each, as compose and k8s start them",
    )
    gpu_sharing: GpuSharing = Field(
        "time_slice",
        description="services that share a GPU (the learner and a replica on one GPU): time_slice = as the "
        "driver does (their kernels take turns); mps = under an MPS daemon of the run's own (their kernels run "
        "side by side; refused without nvidia-cuda-mps-control); auto = mps where that is installed. "
        "time_slice by default: MPS did not pay at the 0.5B shape on an H100 (README)",
    )
    mps_learner_sm_percent: int = Field(
        100,
        ge=1,
        le=100,
        description="under MPS (run.gpu_sharing=mps), the share of the GPU's SMs the learner's kernels may "
        "take (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE); below 100 keeps the rest for the replica's decode, which "
        "the training kernels otherwise crowd out",
    )
    mps_rollout_sm_percent: int = Field(
        100,
        ge=1,
        le=100,
        description="under MPS, the share of the GPU's SMs a replica on the learner's GPU may take",
    )
    on_refusal: Literal["exit", "hold"] = Field(
        "exit",
        description="a service that refuses its configuration: exit 2 (rlbus up, Slurm stop the run), or "
        "hold, unready, until stopped (rlbus's images: compose and k8s would restart-loop an exit). Read "
        "from RLBUS_RUN__ON_REFUSAL before the config loads, so a refused config holds too",
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
    prompt_key: str = Field(
        "prompt", description="row key holding the prompt (text or chat messages; verl's data.prompt_key)"
    )
    answer_key: str = Field(
        "answer",
        description="row key holding the reference answer when there is no reward_model.ground_truth",
    )
    train_batch_size: int = Field(16, ge=1, description="prompts per learner step")
    val_batch_size: int = Field(64, ge=1, description="validation prompts dispatched per held-out evaluation")
    num_train_examples: int = Field(20000, ge=1, description="size of a generated synthetic train split")
    num_val_examples: int = Field(128, ge=1, description="held-out examples the built-in tasks generate")
    max_prompt_length: int = Field(
        64, ge=1, description="prompt tokens at most; longer prompts are cut (verl: truncation)"
    )
    max_response_length: int = Field(
        8, ge=1, description="new tokens per sample at most (the engines' max_tokens)"
    )
    shuffle: bool = Field(True, description="reshuffle the training prompts every epoch")
    seed: int = Field(0, description="seed of the data order and of the built-in tasks' examples")
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
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32",
        description="weight and compute dtype; on a GPU, bf16/fp16 keep fp32 master weights (actor.master_weights)",
    )
    enable_gradient_checkpointing: bool = Field(
        False, description="recompute activations in backward: less memory, more compute"
    )
    use_remove_padding: bool = Field(
        False, description="pack a micro-batch's sequences into one row (varlen attention) instead of padding"
    )
    lora_rank: int = Field(
        0, ge=0, description="LoRA rank; 0 trains every weight (replicas get merged weights either way)"
    )
    lora_alpha: int = Field(16, ge=1, description="LoRA scaling numerator (scale = alpha / rank)")
    target_modules: list[str] | str = Field(
        "all-linear", description="modules that get LoRA adapters: 'all-linear' or a list of names"
    )
    trust_remote_code: bool = Field(
        False, description="let transformers run the checkpoint's own modelling code"
    )
    use_shm: bool = Field(
        False, description="copy the model directory to /dev/shm once per host and load it from there"
    )
    use_fused_kernels: bool = Field(
        True,
        description="log-probs and entropies from chunks of the output projection (never full-vocabulary "
        "fp32 logits); false = the plain full-logits path",
    )
    logprob_chunk_tokens: int = Field(
        4096,
        ge=1,
        description="tokens per chunk of the fused log-prob path (H200, Qwen2-0.5B: 4096 ran 5% faster than 1024 for 1.8 GB more)",
    )
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
    name: Literal["hf", "vllm", "sglang"] = Field(
        "hf", description="generation engine: hf (embedded transformers), vllm or sglang (a running server)"
    )
    n: int = Field(8, ge=1, description="samples per prompt (the GRPO group size)")
    temperature: float = Field(0.7, ge=0.0, description="0.7 suits the bundled tiny model; verl uses 1.0")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="nucleus sampling mass (1.0 = off)")
    top_k: int = Field(-1, ge=-1, description="-1 = off")
    stop: list[str] = Field(
        default_factory=list, description="stop strings; generation ends after the first one"
    )
    ignore_eos: bool = Field(
        False, description="generate max_response_length tokens past end tokens (benchmarks)"
    )
    prompts_per_batch: int = Field(
        8,
        ge=1,
        description="training prompts a replica generates together: a batch holds up to prompts_per_batch x n "
        "rows, so validation prompts (n=1) come n times as many to a pass",
    )
    replicas: int = Field(1, ge=1, description="rollout processes `rlbus up` starts")
    seed: int = Field(
        0, description="sampling seed of the replicas (each replica and call derives its own from it)"
    )
    seed_per_prompt: bool = Field(
        False,
        description="seed each prompt's sampling from (seed, data index): the same samples whoever "
        "generates it and whenever (reproducible runs and resumes); slower, seeded requests run alone",
    )
    tensor_model_parallel_size: int = Field(
        1, ge=1, description="GPUs one vLLM replica shards the model over"
    )
    gpu_memory_utilization: float = Field(
        0.5,
        gt=0.0,
        le=1.0,
        description="share of the GPU this replica may take (vllm/sglang: their KV sizing; "
        "hf: a cap on the process's allocations), leaving the rest to a learner on the same GPU",
    )
    max_num_seqs: int = Field(256, ge=1, description="sequences a vLLM replica runs at once")
    enforce_eager: bool | None = Field(
        None,
        description="no compiled/CUDA-graph decode; None = the engine's choice (eager on CPU, compiled "
        "decode on GPU: vLLM's CUDA graphs, the hf engine's static KV cache for a model of 10M parameters "
        "or more)",
    )
    decode_small_bucket: bool = Field(
        False,
        description="hf engine: a second compiled decode shape, an eighth of a fetch's rows, for small batches "
        "(validation, partial fetches); off, they are padded to the fetch's rows, which saves that shape's "
        "compile at start (12-23 s on an H100) for a few padded decode steps",
    )
    decode_step: Literal["inductor", "recorded", "recorded_then_inductor"] = Field(
        "inductor",
        description="hf engine on a GPU: how its decode step runs, once per batch shape: inductor compiles it "
        "(fused kernels in CUDA graphs; 12-23 s a shape at start on an H100), recorded records the model's "
        "own kernels as a CUDA graph (no compile: 3-5 s at start at 75M, but 1.65x slower decode there), "
        "recorded_then_inductor serves recorded from the start while inductor compiles the step on a thread, "
        "and decodes compiled from the batch after the compile ends",
    )
    enable_prefix_caching: bool = Field(
        True, description="vLLM reuses the KV cache of shared prompt prefixes (the n samples of a prompt)"
    )
    sglang_url: str | None = Field(
        None, description="the SGLang server a replica drives (rollout.name=sglang)"
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="where a replica generates: auto picks a GPU when there is one"
    )
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
    http_url: str | None = Field(
        None, description="endpoint POSTed {prompt, response, meta} when reward.type=http"
    )
    on_error_score: float = Field(
        0.0, description="reward of a sample whose scorer raised or timed out (counted as reward errors)"
    )
    timeout_s: float = Field(
        10.0, gt=0, description="seconds one scoring call may take before it counts as an error"
    )
    memory_limit_mb: int = Field(
        1024, ge=16, description="address-space limit of the sandbox that runs user reward functions"
    )
    gsm8k_method: Literal["strict", "flexible", "any"] = Field(
        "strict",
        description="the built-in GSM8K verifier's answer: strict = the number after the last '#### ' (verl's "
        "default), flexible = the last number (verl's), any = the last \\boxed{}, else '####', else the last number",
    )
    format_score: float = Field(
        0.0,
        description="GSM8K: reward of an answer found in the right format but wrong (verl's format_score)",
    )
    max_failed_groups: int = Field(
        20,
        ge=0,
        description="this many groups in a row whose every reward call failed stop the run with the first "
        "error (0: never; each failed sample still scores on_error_score)",
    )

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

    enable: bool = Field(
        False, description="score with a reward model (verl's reward_model.enable; reward.type=model)"
    )
    model_path: Path | None = Field(None, description="HF sequence-classification checkpoint (num_labels=1)")
    micro_batch_size: int = Field(16, ge=1, description="responses per forward pass")
    max_length: int | None = Field(None, ge=1, description="truncate prompt + response to this many tokens")
    device: str = Field("auto", description="auto = the reward process's GPU if it has one, else CPU")
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="dtype the reward model loads in"
    )
    correct_threshold: float = Field(0.0, description="a score above this counts as correct (metrics only)")

    @model_validator(mode="after")
    def _needs_model(self) -> RewardModelConfig:
        if self.enable and self.model_path is None:
            raise ValueError("reward_model.model.path is required when reward_model.enable=true")
        return self


class CustomRewardFunctionConfig(Section):
    """verl's `custom_reward_function.path/name`: a file with compute_score(data_source, solution_str,
    ground_truth, extra_info); it becomes reward.type=function with verl's signature."""

    path: Path | None = Field(
        None, description="Python file with the reward function (verl's custom_reward_function.path)"
    )
    name: str = Field("compute_score", description="the function's name in that file")


class RefConfig(Section):
    device: Literal["auto", "cpu", "cuda"] | None = Field(
        None, description="where the reference model runs; None = trainer.device (where it ran before)"
    )
    micro_batch_size: int = Field(16, ge=1, description="sequences per reference forward pass")
    model_path: Path | None = Field(None, description="None = the policy's initial weights")


PLACEHOLDER_SECRET_PREFIX = "change-me"  # k8s/secret.yaml ships one: refused wherever it arrives


class BusConfig(Section):
    url: str | None = Field(
        None, description="nats:// URL; None = use 127.0.0.1:4222 if it answers, else start one"
    )
    local_port: int = Field(0, ge=0, description="port for a server rlbus starts itself; 0 = pick a free one")
    ack_wait_s: float = Field(
        60.0, gt=0, description="seconds a delivered work item may stay un-acked before NATS redelivers it"
    )
    max_deliver: int = Field(5, ge=1, description="deliveries before a work item is dead-lettered")
    max_payload_bytes: int = Field(
        8 * 1024 * 1024, ge=1024, description="max_payload for a server rlbus starts"
    )
    roles: bool = Field(
        True,
        description="with no bus.url, `rlbus up` starts its own NATS server with one user per process, each "
        "allowed to publish only what its role publishes (rlbus.bus.roles); false: use an open server on "
        "127.0.0.1:4222 when one answers, as any client may",
    )
    cluster_size: int = Field(
        1,
        ge=1,
        description="with no bus.url, `rlbus up` starts a local NATS cluster of this many servers (routes, "
        "a JetStream meta-group): 1, or an odd number (3 survives one server's death)",
    )
    replicas: int = Field(
        0,
        ge=0,
        le=5,
        description="copies of each stream, KV bucket and object store on a clustered bus (0: 3 when "
        "bus.cluster_size >= 3, else 1); set 3 for an external cluster (compose, k8s)",
    )
    partitions: int = Field(
        1,
        ge=1,
        le=64,
        description="subjects (each a stream of its own) per stage, a work item's prompt id hashed to one: "
        "on a cluster each partition has its own stream leader, and every service fetches from all of "
        "them; every process of a run must use the same number",
    )
    trajectory_log: bool = Field(
        False,
        description="keep every trained group in a retained stream of the run (limits below), for "
        "`rlbus replay <run dir>` to export to parquet in verl's rollout_data_dir schema",
    )
    trajectory_log_max_age_h: float = Field(
        168.0, gt=0, description="hours a trained group stays in the trajectory log"
    )
    trajectory_log_max_gb: float = Field(
        10.0, gt=0, description="size of the trajectory log; the oldest groups go first beyond it"
    )
    user: str | None = Field(None, description="NATS user (with bus.password)")
    password: str | None = Field(None, description="NATS password")
    token: str | None = Field(None, description="NATS token")
    creds_file: Path | None = Field(None, description="NATS credentials file (JWT + NKey)")
    nkeys_seed: Path | None = Field(None, description="NKey seed file")
    tls_ca: Path | None = Field(None, description="CA certificate the server's certificate must chain to")
    tls_cert: Path | None = Field(None, description="client certificate (mutual TLS)")
    tls_key: Path | None = Field(None, description="client key (mutual TLS)")
    connect_timeout_s: float = Field(5.0, gt=0, description="seconds one connection attempt may take")
    storage: Literal["file", "memory"] = Field(
        "file",
        description="JetStream storage of the run's streams: file (survives a server restart) or memory",
    )

    @field_validator("cluster_size")
    @classmethod
    def _odd_cluster(cls, value: int) -> int:
        """A JetStream meta-group needs a majority: 2 servers die with one, as 1 does."""
        if value > 1 and value % 2 == 0:
            raise ValueError(f"must be 1 or odd (3, 5): {value} servers lose their quorum with one down")
        return value

    @property
    def stream_replicas(self) -> int:
        """Copies of each stream, bucket and store (bus.replicas, else 3 on a local cluster of 3 or more)."""
        return self.replicas or (3 if self.cluster_size >= 3 else 1)

    @field_validator("token", "password")
    @classmethod
    def _no_placeholder_secret(cls, value: str | None) -> str | None:
        """A shipped placeholder (k8s/secret.yaml's) or an empty secret is no secret: anyone can guess it."""
        if value is None:
            return value
        if not value.strip():
            raise ValueError("is empty; unset it, or set a real secret (e.g. `openssl rand -hex 24`)")
        if value.strip().lower().startswith(PLACEHOLDER_SECRET_PREFIX):
            raise ValueError(
                f"is the placeholder {value!r} shipped in k8s/secret.yaml; replace it with a real secret "
                '(kubectl -n rlbus create secret generic rlbus-nats --from-literal=token="$(openssl rand -hex 24)")'
            )
        return value


class LoggingConfig(Section):
    level: Literal["debug", "info", "warning", "error"] = Field(
        "info", description="log level of every service"
    )
    json_logs: bool = Field(
        False, description="one JSON object per log line (for log shippers) instead of text"
    )
