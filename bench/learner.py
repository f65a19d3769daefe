"""Learner step benchmark: tokens/s, MFU and peak memory of one training step (forward + backward + optimizer).

Runs, one after the other on the same batch:

* ``plain-bf16``: the loop a user writes by hand, the baseline of the ratio column: the model held in bf16,
  SDPA attention, fused AdamW, the model's own cross-entropy (``labels=``) over the whole sequence,
  gradient accumulation over micro-batches, ``clip_grad_norm_``. ``plain``: the same with fp32 weights under
  ``torch.autocast(bf16)`` and the loss on the response tokens.
* ``rlbus``: ``rlbus.learner.trainer.PolicyTrainer.train_step`` with the default learner config (GRPO
  advantages, clipped PG loss, entropy and log-prob diagnostics; chunked log-probs, compiled layers on
  CUDA, bf16 parameters with the fp32 master in the optimizer), padded micro-batches of the same size.
  Name parts add to it (``SUFFIX_OVERRIDES``): ``+nofuse`` full-vocabulary logits, ``+autocast`` fp32
  parameters under autocast, ``+eager`` no torch.compile, ``+liger`` Liger's kernels, ``+pack`` sequence
  packing (varlen flash attention on CUDA) bounded by ``actor.ppo_max_token_len_per_gpu``, ``+gc`` gradient
  checkpointing, ``+lora`` LoRA r=16, ``+fsdp`` FSDP2 over a world of one, ``+offload`` CPUOffloadPolicy.
* ``/var``: the same on a batch of mixed lengths (uniform in [seq_len/8, seq_len]): padding vs packing.

The model is Qwen2-0.5B-sized (hidden 896, 24 layers, 14 heads, 2 KV heads, intermediate 4864, vocab
151936, tied embeddings) with random weights, built locally; `--shape learning` is
``bench/learning.py``'s 75.5M model (hidden 768, 12 layers, a 54-token vocabulary), whose update that bench
waits for. MFU = model FLOPs/s over the peak
(``--peak-tflops``, default 989 = H200/H100 dense bf16): 6 x matmul parameters (lm_head included) + causal
attention per token, recompute not counted, padding not counted (see ``perf.train_flops_per_token``).

Each config runs in a process of its own (``--in-process``: all in this one), as a learner runs one
config: timed one after another in one process, configs changed each other's numbers.

Measured on one H200 (torch 2.11, transformers 5.17; seq_len 2048, 16 sequences, micro-batch 8, bf16, the
median of 4 steps), 2026-12-04 13:58 UTC: plain-bf16 84.0k tok/s (27.4% MFU, 52.7 GB); rlbus 117.2k (38.2%,
25.3 GB, 1.39x); rlbus+pack 116.6k (1.00x padded); mixed lengths: plain-bf16 44.1k, rlbus 66.5k,
rlbus+pack 91.2k (1.37x padded; 1.37-1.60x over six processes that day, paired round by round).
The README's Benchmarks section has the table, the command and what changed.

Runs from a plain checkout without installing the package (``rlbus`` -> ``shared/``,
``rlbus.<service>`` -> ``services/<service>/`` are mapped at start-up):

    python bench/learner.py                               # GPU: the full comparison (~6 min on an H200)
    python bench/learner.py --tiny --device cpu --steps 1 # a smoke run of the script on a CPU
    python bench/learner.py --seq-len 1024 --batch 32 --configs plain,rlbus
    torchrun --nproc-per-node 2 bench/learner.py --configs rlbus   # FSDP2 over 2 GPUs, the same global batch
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CONFIGS = [
    "plain-bf16",
    "plain-bf16+compile",
    "rlbus",
    "rlbus+autocast",
    "rlbus+eager",
    "rlbus+nofuse",
    "rlbus+liger",
    "rlbus+pack",
    "rlbus+gc",
    "plain-bf16/var",
    "rlbus/var",
    "rlbus+pack/var",
]
ALL_CONFIGS = [
    *DEFAULT_CONFIGS,
    "plain",
    "plain/var",
    "rlbus+fsdp",
    "rlbus+lora",
    "rlbus+offload",
    "rlbus+pack+liger",
    "rlbus+pack+liger/var",
    "rlbus+eager/var",
    "rlbus+eager+pack/var",
    "rlbus+liger+autocast",
    "rlbus+chunk4k",
    "rlbus+pack+chunk4k/var",
]
# What each name part adds to the rlbus config (several combine: rlbus+pack+liger).
SUFFIX_OVERRIDES = {
    "+pack": ["model.use_remove_padding=true", "actor.use_dynamic_bsz=true"],
    "+gc": ["model.enable_gradient_checkpointing=true"],
    "+lora": ["model.lora_rank=16", "model.lora_alpha=32"],
    "+offload": ["actor.param_offload=true"],
    "+nofuse": ["model.use_fused_kernels=false"],
    "+liger": ["model.use_liger=true"],
    "+compile": ["actor.use_torch_compile=true"],
    "+eager": ["actor.use_torch_compile=false"],
    "+master": ["actor.master_weights=optimizer"],
    "+autocast": ["actor.master_weights=model"],
    "+chunk4k": ["model.logprob_chunk_tokens=4096"],
}


def lacks(name: str, device: str) -> str | None:
    """What a config needs that this machine has not (None: it can run here)."""
    if "+liger" in name:
        if importlib.util.find_spec("liger_kernel") is None:
            return "liger-kernel (the gpu extra: pip install -e '.[gpu]')"
        if device != "cuda":
            return "a CUDA device (Liger's kernels are Triton kernels)"
    return None


def bootstrap_rlbus(force: bool = False) -> str:
    """Make ``import rlbus`` work: the installed package if there is one, else the checkout's folders."""
    if not force:
        try:
            import rlbus.learner.model  # noqa: F401

            return "installed"
        except ImportError:
            pass
    for name in [m for m in sys.modules if m == "rlbus" or m.startswith("rlbus.")]:
        del sys.modules[name]
    spec = importlib.util.spec_from_file_location(
        "rlbus",
        ROOT / "shared" / "__init__.py",
        submodule_search_locations=[str(ROOT / "shared"), str(ROOT / "services")],
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["rlbus"] = module
    spec.loader.exec_module(module)
    return f"checkout {ROOT}"


def model_config(args: argparse.Namespace):
    from transformers import Qwen2Config

    if args.tiny:
        return Qwen2Config(
            vocab_size=512,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=4096,
            tie_word_embeddings=True,
        )
    if args.shape == "learning":  # bench/learning.py's model (its GPU shape) on rlbus's character tokenizer
        from learning import shape

        from rlbus.tiny_model import make_config, make_tokenizer

        return make_config(
            make_tokenizer(), max_position_embeddings=512, **shape(argparse.Namespace(tiny=False))
        )
    return Qwen2Config(
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=args.layers,
        num_attention_heads=14,
        num_key_value_heads=2,
        max_position_embeddings=32768,
        rope_theta=1e6,
        tie_word_embeddings=True,
        rms_norm_eps=1e-6,
    )


def build_model_dir(config: Any, out: Path) -> Path:
    import torch
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = Qwen2ForCausalLM(config)
    model.to(torch.bfloat16).save_pretrained(str(out))
    del model
    return out


def make_batch(lengths: list[int], vocab: int, prompt_len: int, group: int, seed: int = 0):
    """A GRPO batch: groups of `group` samples, right padded; responses after `prompt_len` prompt tokens."""
    import torch

    from rlbus.learner.batch import TrainBatch

    g = torch.Generator().manual_seed(seed)
    bsz, width = len(lengths), max(lengths)
    ids = torch.zeros(bsz, width, dtype=torch.long)
    mask = torch.zeros(bsz, width, dtype=torch.long)
    resp = torch.zeros(bsz, width - 1)
    for b, n in enumerate(lengths):
        ids[b, :n] = torch.randint(10, vocab, (n,), generator=g)
        mask[b, :n] = 1
        p = min(prompt_len, n - 1)
        resp[b, p - 1 : n - 1] = 1.0
    pos = (mask.cumsum(-1) - 1).clamp(min=0) * mask
    return TrainBatch(
        input_ids=ids,
        attention_mask=mask,
        position_ids=pos,
        response_mask=resp,
        behaviour_logprobs=-torch.rand(bsz, width - 1, generator=g) * resp,
        ref_logprobs=None,
        rewards=torch.rand(bsz, generator=g),
        correct=torch.zeros(bsz, dtype=torch.bool),
        group_ids=torch.arange(bsz) // group,
        policy_versions=torch.zeros(bsz, dtype=torch.long),
        temperature=1.0,
    )


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


PROFILE: dict[str, Any] = {}  # --profile-dir: where time_steps writes a profile of one extra step


def time_steps(step: Any, warmup: int, steps: int) -> dict[str, Any]:
    """``times``: each timed step's seconds; ``dynamo_during_timing``: what dynamo compiled during them (a
    config that still compiles or breaks graphs in its timed steps reads slow for that reason)."""
    for _ in range(warmup):
        step()
    _sync()
    before = dynamo_counts()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        _sync()
        times.append(time.perf_counter() - t0)
    after = dynamo_counts()
    if PROFILE.get("dir"):
        profile_step(step, Path(PROFILE["dir"]) / f"{file_stem(PROFILE['name'])}.txt")
    return {"times": times, "dynamo_during_timing": {k: after[k] - before[k] for k in after}}


def file_stem(config: str) -> str:
    """A config's name as a file name any tool copies (no ``/`` or ``+``)."""
    return config.replace("/", "_").replace("+", "_")


def dynamo_counts() -> dict[str, int]:
    """Graphs dynamo compiled and graph breaks it met so far in this process."""
    from torch._dynamo.utils import counters

    return {
        "graphs_compiled": int(counters["stats"]["unique_graphs"]),
        "graph_breaks": int(sum(counters["graph_break"].values())),
    }


def profile_step(step: Any, out: Path) -> None:
    """One more step under torch.profiler: the ops by self device time (CPU time on a CPU), to a file."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    t0 = time.perf_counter()
    with profile(activities=activities) as prof:
        step()
        _sync()
    wall = time.perf_counter() - t0
    averages = prof.key_averages()
    tables = [averages.table(sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=70)]
    if cuda:  # the host's view first: a step whose device time is below its wall time waits on the host
        tables.append(averages.table(sort_by="self_cuda_time_total", row_limit=40, max_name_column_width=70))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(f"profiled step: {wall:.3f}s wall\n" + "\n".join(tables) + "\n")
    print(f"  profile of one step ({wall:.3f}s) -> {out}", flush=True)


def run_rlbus(model_dir: Path, batch: Any, args: argparse.Namespace, name: str) -> dict[str, Any]:
    """Under torchrun, rank 0 runs this while the other ranks follow (``follow_rlbus``)."""

    from rlbus.learner.dist import context as dist_context
    from rlbus.learner.trainer import PolicyTrainer

    cfg = rlbus_config(model_dir, args, name)
    if "+fsdp" in name:
        os.environ["RLBUS_FSDP"] = "1"  # FSDP2 even on one GPU (a world of one): what N ranks each run
    try:
        trainer = PolicyTrainer(cfg, model_dir, this_device(args), total_steps=100)
        return time_rlbus(trainer, batch, args, "+pack" in name)
    finally:
        os.environ.pop("RLBUS_FSDP", None)
        dist_context.context().stop_workers()  # under torchrun: free the followers for the next config


def follow_rlbus(model_dir: Path, args: argparse.Namespace, name: str) -> None:
    """A rank > 0 of a torchrun: builds the same trainer and follows rank 0's steps until it is done."""
    from rlbus.learner.dist import worker

    if worker.worker_main(rlbus_config(model_dir, args, name)) != 0:
        raise RuntimeError(f"{name}: a follower rank failed")


def this_device(args: argparse.Namespace) -> Any:
    """The device of this process: cuda:LOCAL_RANK under torchrun, else --device."""
    import torch

    if args.device == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(args.device)


def rlbus_config(model_dir: Path, args: argparse.Namespace, name: str) -> Any:
    """The learner config of one rlbus config name (every rank of a torchrun builds the same)."""
    from rlbus.config import load_config

    overrides = [
        f"model.path={model_dir}",
        f"model.dtype={args.dtype}",
        f"trainer.device={args.device}",
        f"actor.ppo_micro_batch_size={args.micro}",
        "actor.ppo_mini_batch_size=0",
        "actor.ppo_epochs=1",
        "actor.optim.lr=1e-6",
        f"data.max_response_length={args.seq_len}",
        f"actor.ppo_max_token_len_per_gpu={args.micro * args.seq_len}",
    ]
    for suffix, extra in SUFFIX_OVERRIDES.items():
        if suffix in name:
            overrides += extra
    return load_config(None, overrides)


def time_rlbus(trainer: Any, batch: Any, args: argparse.Namespace, packed: bool) -> dict[str, Any]:
    import torch
    from torch.distributed.fsdp import FSDPModule

    from rlbus.learner import forward

    out: dict[str, Any] = {
        "attn": trainer.model.config._attn_implementation,
        "fsdp": isinstance(trainer.model, FSDPModule),
    }
    if trainer.par.world_size == 1:  # ranks plan their micro-batches together, inside a led step only
        out["micro_batches"] = len(trainer._micro_batches(batch))
    if packed and trainer.par.world_size == 1:  # the packed path must compute what the padded one does
        probe = batch.select(list(range(min(4, batch.size))))
        with torch.no_grad():
            a, _ = forward.forward_logprobs(trainer.model, probe, trainer.device, True, False)
            b, _ = forward.forward_logprobs(trainer.model, probe, trainer.device, False, False)
        m = probe.response_mask.to(a.device).bool()
        out["packed_vs_padded_max_abs_dlogp"] = float((a - b).abs()[m].max())
    metrics: dict[str, float] = {}

    def step() -> None:
        metrics.update(trainer.train_step(batch))

    out.update(time_steps(step, args.warmup, args.steps))
    out["loss"] = metrics.get("actor/loss")
    t0 = time.perf_counter()  # what a weight push streams: every full tensor once (all-gathered under FSDP)
    out["full_state_gb"] = sum(t.numel() * t.element_size() for _, t in trainer.named_weights()) / 1e9
    _sync()
    out["full_state_s"] = time.perf_counter() - t0
    return out


def run_plain(model_dir: Path, batch: Any, args: argparse.Namespace, name: str) -> dict[str, Any]:
    """``plain``: fp32 weights under bf16 autocast, loss on the response tokens. ``plain-bf16``: the loop a
    user writes by hand: the model held in bf16, fused AdamW, the model's own loss over the whole sequence.
    ``plain-bf16+compile``: that loop with ``torch.compile`` on the model."""
    import torch
    from transformers import AutoModelForCausalLM

    dev = torch.device(args.device)
    bf16 = name.startswith("plain-bf16")
    dtype = torch.bfloat16 if bf16 and args.dtype == "bfloat16" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype, attn_implementation="sdpa")
    model.to(dev).train()
    if args.plain_gc:
        model.gradient_checkpointing_enable()
    if (
        "+compile" in name
    ):  # the same loop with torch.compile on the whole model (dynamic shapes as they come)
        model = torch.compile(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=dev.type == "cuda")
    micro = args.micro
    amp = torch.autocast(dev.type, dtype=torch.bfloat16, enabled=args.dtype == "bfloat16" and not bf16)
    n_micro = math.ceil(batch.size / micro)
    loss_box: list[float] = []

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        for i in range(0, batch.size, micro):
            mb = batch.select(list(range(i, min(i + micro, batch.size))))
            width = int(mb.attention_mask.sum(-1).max())
            ids = mb.input_ids[:, :width].to(dev)
            mask = mb.attention_mask[:, :width].to(dev)
            labels = ids.masked_fill(mask == 0, -100)
            if not bf16:  # train on the response tokens only
                labels[:, 1:][mb.response_mask[:, : width - 1].to(dev) == 0] = -100
                labels[:, 0] = -100
            with amp:
                loss = (
                    model(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).loss / n_micro
                )
            loss.backward()
            loss_box.append(float(loss.detach()))
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    out = {
        **time_steps(step, args.warmup, args.steps),
        "attn": "sdpa",
        "fsdp": False,
        "micro_batches": n_micro,
        "loss": loss_box[-1] if loss_box else None,
    }
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--batch", type=int, default=16, help="sequences per step")
    p.add_argument(
        "--micro", type=int, default=8, help="sequences per micro-batch (packed: micro x seq-len tokens)"
    )
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--group", type=int, default=4, help="GRPO group size")
    p.add_argument("--layers", type=int, default=24, help="decoder layers of the 0.5B shape")
    p.add_argument(
        "--shape",
        choices=["0.5b", "learning"],
        default="0.5b",
        help="0.5b: Qwen2-0.5B's; learning: bench/learning.py's 75.5M model on a 54-token vocabulary",
    )
    p.add_argument("--steps", type=int, default=3, help="timed steps (median reported)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--device", default="auto")
    p.add_argument("--configs", default=",".join(DEFAULT_CONFIGS), help=f"any of {','.join(ALL_CONFIGS)}")
    p.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak of one GPU")
    p.add_argument("--plain-gc", action="store_true", help="gradient checkpointing in the plain loop too")
    p.add_argument("--tiny", action="store_true", help="a 2-layer toy model (smoke test)")
    p.add_argument("--force-checkout-imports", action="store_true")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--profile-dir", default=None, help="profile one extra step per config into this folder")
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="time every config this many times, in turn (median round shown)",
    )
    p.add_argument(
        "--in-process", action="store_true", help="all configs in this process (default: a process each)"
    )
    p.add_argument("--model-dir", default=None, help=argparse.SUPPRESS)  # a child reuses the parent's model
    p.add_argument("--no-table", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    PROFILE["dir"] = args.profile_dir

    where = bootstrap_rlbus(args.force_checkout_imports)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    import torch

    from rlbus.learner.dist import context as dist_context

    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.tiny:
        args.seq_len, args.prompt_len = min(args.seq_len, 64), min(args.prompt_len, 16)
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = sorted(set(configs) - set(ALL_CONFIGS))
    if unknown:
        p.error(f"unknown configs {unknown}; choose from {ALL_CONFIGS}")
    missing = {c: why for c in configs if (why := lacks(c, args.device))}
    if missing and args.configs != ",".join(DEFAULT_CONFIGS):
        p.error("; ".join(f"{c} needs {why}" for c, why in missing.items()))
    for c, why in missing.items():  # the default list runs what this machine can
        print(f"skipping {c}: it needs {why}", flush=True)
    configs = [c for c in configs if c not in missing]
    # under torchrun every rank joins, rank 0 measures and the others follow each rlbus config (the plain
    # loops are single-process: skipped); a process that only starts one child per config stays off the GPU
    in_process = args.in_process or len(configs) == 1
    if in_process or int(os.environ.get("WORLD_SIZE", "1")) > 1:
        ctx = dist_context.init_distributed(args.device)  # on a GPU a world of one: FSDP2's mixed precision
        if ctx.world_size > 1:
            return main_ranks(args, configs, ctx)
    if not args.model_dir:
        gpu = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
        print(f"rlbus from {where}; torch {torch.__version__}; device {gpu}", flush=True)
    config = model_config(args)
    fixed, var = batch_lengths(args)
    with tempfile.TemporaryDirectory(prefix="rlbus-bench-") as tmp:
        if args.model_dir:
            model_dir = Path(args.model_dir)
        else:
            t0 = time.perf_counter()
            model_dir = build_model_dir(config, Path(tmp) / "model")
            print(
                f"model: {sum(1 for _ in model_dir.iterdir())} files in {time.perf_counter() - t0:.1f}s",
                flush=True,
            )
        rounds: dict[str, list[dict[str, Any]]] = {}
        for _ in range(args.rounds):  # configs in turn, so that a slow spell of the machine hits them all
            for name in configs:
                if in_process:
                    res = measure_config(name, model_dir, args, config, fixed, var)
                else:
                    res = measure_in_child(name, model_dir, argv, Path(tmp))
                rounds.setdefault(name, []).append(res)
        results = {name: median_round(runs) for name, runs in rounds.items()}
    if not args.no_table:
        print_table(results, args, config)
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "results": results}, indent=2, default=str))
    dist_context.shutdown()
    return 0 if all("error" not in r for r in results.values()) else 1


_PEAK: dict[str, float] = {}


def measured_peak_tflops(args: argparse.Namespace) -> float:
    """The matmul throughput this device reaches in the bench's dtype (a square GEMM timed after a warm-up):
    MFU against it says how close a step comes to what the chip does in practice, beside the nominal peak."""
    key = f"{args.device}:{args.dtype}"
    if key not in _PEAK:
        import torch

        dev = torch.device(args.device)
        dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
        n = 8192 if dev.type == "cuda" else 1024
        a, b = torch.randn(n, n, device=dev, dtype=dtype), torch.randn(n, n, device=dev, dtype=dtype)
        for _ in range(3):
            a @ b
        if dev.type == "cuda":
            torch.cuda.synchronize()
        reps, t0 = 20 if dev.type == "cuda" else 5, time.perf_counter()
        for _ in range(reps):
            a @ b
        if dev.type == "cuda":
            torch.cuda.synchronize()
        _PEAK[key] = 2 * n**3 * reps / (time.perf_counter() - t0) / 1e12
    return _PEAK[key]


def measure_config(
    name: str, model_dir: Path, args: argparse.Namespace, config: Any, fixed: list[int], var: list[int]
) -> dict[str, Any]:
    """Time one config in this process: its step times, tokens/s, MFU and peak memory (or its error)."""
    import torch

    from rlbus.learner import perf

    lengths = var if name.endswith("/var") else fixed
    batch = make_batch(lengths, config.vocab_size, args.prompt_len, args.group)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    PROFILE["name"] = name
    try:
        res = (
            run_plain(model_dir, batch, args, name)
            if name.startswith("plain")
            else run_rlbus(model_dir, batch, args, name)
        )
    except Exception as exc:  # one failing config must not lose the others' numbers
        import traceback

        traceback.print_exc()
        return {"error": repr(exc)}
    finally:
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    tokens = sum(lengths)
    flops_tok = flops_per_token(config, lengths)
    step_s = statistics.median(res["times"])
    res.update(
        tokens=tokens,
        padded_tokens=len(lengths) * max(lengths),
        step_s=step_s,
        tokens_per_s=tokens / step_s,
        mfu=perf.mfu(tokens / step_s, flops_tok, args.peak_tflops * 1e12),
        mfu_measured=perf.mfu(tokens / step_s, flops_tok, measured_peak_tflops(args) * 1e12),
        peak_tflops_measured=measured_peak_tflops(args),
        tflops=tokens / step_s * flops_tok / 1e12,
        wall_s=time.perf_counter() - t0,
        peak_mem_gb=torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0,
    )
    print(
        f"  {name:16s} step {step_s:7.3f}s  {res['tokens_per_s']:10.0f} tok/s  MFU {res['mfu']:6.1%}  "
        f"({res['wall_s']:.0f}s incl. set-up); steps {' '.join(f'{t:.3f}' for t in res['times'])}; "
        f"during them dynamo {res.get('dynamo_during_timing', {})}",
        flush=True,
    )
    return res


def measure_in_child(name: str, model_dir: Path, argv: list[str] | None, tmp: Path) -> dict[str, Any]:
    """One config in a fresh process, as a learner runs one config per process: configs timed one after
    another in one process changed each other's numbers (Liger patches transformers' modeling module for
    the whole process, and the compiled blocks of earlier configs stay in dynamo's caches; measured on the
    H200: +pack 119k -> 88-108k tok/s depending on what ran before it)."""
    out = tmp / f"{file_stem(name)}.json"
    cmd = [sys.executable, __file__, *(sys.argv[1:] if argv is None else argv)]
    cmd += [
        "--configs",
        name,
        "--rounds",
        "1",
        "--out",
        str(out),
        "--model-dir",
        str(model_dir),
        "--no-table",
    ]
    rc = subprocess.run(cmd, check=False).returncode
    if not out.exists():
        return {"error": f"the child process for {name} exited {rc} without results"}
    return json.loads(out.read_text())["results"][name]


def median_round(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """A config's rounds as one result: the round of median tokens/s, with every round's tokens/s beside
    it (an error in any round is the result)."""
    failed = [r for r in runs if "error" in r]
    if failed:
        return failed[0]
    ranked = sorted(runs, key=lambda r: r["tokens_per_s"])
    return {**ranked[(len(ranked) - 1) // 2], "rounds_tokens_per_s": [r["tokens_per_s"] for r in runs]}


def packed_vs_padded(results: dict[str, Any]) -> dict[str, tuple[list[float], float]]:
    """Each packed config's tokens/s over its padded twin's, round by round (the two ran back to back in
    each round, so a slow spell of the machine hits both) and the median of those paired ratios."""
    paired = {}
    for name, r in results.items():
        twin = results.get(name.replace("+pack", ""), {})
        if "+pack" not in name or "rounds_tokens_per_s" not in r or "rounds_tokens_per_s" not in twin:
            continue
        ratios = [a / b for a, b in zip(r["rounds_tokens_per_s"], twin["rounds_tokens_per_s"], strict=True)]
        paired[name] = (ratios, statistics.median(ratios))
    return paired


def flops_per_token(config: Any, lengths: list[int]) -> float:
    """Training FLOPs per real token of a batch of these sequence lengths (attention by its mean n^2)."""
    from rlbus.learner import perf

    return perf.train_flops_per_token(config, sum(n * n for n in lengths) / sum(lengths))


def batch_lengths(args: argparse.Namespace) -> tuple[list[int], list[int]]:
    """Sequence lengths of the equal-length batch and of the mixed one (uniform in [seq_len/8, seq_len])."""
    import torch

    g = torch.Generator().manual_seed(1)
    low = max(args.prompt_len + 2, args.seq_len // 8)
    var = [int(x) for x in torch.randint(low, args.seq_len + 1, (args.batch,), generator=g)]
    return [args.seq_len] * args.batch, var


def main_ranks(args: argparse.Namespace, configs: list[str], ctx: Any) -> int:
    """``torchrun --nproc-per-node N bench/learner.py``: the rlbus configs with FSDP2 over N ranks on the
    same global batch; tokens/s counts the whole batch, MFU is per GPU (the peak times N)."""
    import torch.distributed as dist

    from rlbus.learner import perf
    from rlbus.learner.dist import context as dist_context

    skipped = [c for c in configs if c.startswith("plain")]
    configs = [c for c in configs if not c.startswith("plain")]
    config = model_config(args)
    fixed, var = batch_lengths(args)
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="rlbus-bench-") as tmp:
        where = [str(build_model_dir(config, Path(tmp) / "model")) if ctx.rank == 0 else ""]
        dist.broadcast_object_list(where, src=0)  # one host: the ranks read rank 0's files
        model_dir = Path(where[0])
        if ctx.rank == 0:
            print(f"{ctx.world_size} ranks on {args.device}; plain loops skipped: {skipped}", flush=True)
        for name in configs:
            if ctx.rank:
                follow_rlbus(model_dir, args, name)
                continue
            lengths = var if name.endswith("/var") else fixed
            batch = make_batch(lengths, config.vocab_size, args.prompt_len, args.group)
            res = run_rlbus(model_dir, batch, args, name)
            tokens = sum(lengths)
            step_s = statistics.median(res["times"])
            flops_tok = flops_per_token(config, lengths)
            peak = args.peak_tflops * 1e12 * ctx.world_size
            results[name] = {**res, "step_s": step_s, "tokens_per_s": tokens / step_s}
            print(
                f"  {name:16s} {ctx.world_size} ranks: step {step_s:7.3f}s  {tokens / step_s:10.0f} tok/s  "
                f"MFU {perf.mfu(tokens / step_s, flops_tok, peak):6.1%} per GPU",
                flush=True,
            )
        dist.barrier()  # rank 0's files stay until every rank is done with them
    if args.out and ctx.rank == 0:
        Path(args.out).write_text(json.dumps({"args": vars(args), "results": results}, indent=2, default=str))
    dist_context.shutdown()
    return 0


def print_table(results: dict[str, Any], args: argparse.Namespace, config: Any) -> None:
    print(
        f"\nseq_len {args.seq_len}, batch {args.batch} sequences, micro-batch {args.micro}, {args.dtype}, "
        f"{config.num_hidden_layers} layers x hidden {config.hidden_size}, vocab {config.vocab_size}"
    )
    header = (
        f"{'config':20s} {'attn':13s} {'tokens':>7s} {'pad%':>5s} {'mb':>3s} {'step s':>8s} {'tok/s':>9s} "
        f"{'TFLOP/s':>8s} {'MFU':>6s} {'MFUm':>6s} {'mem GB':>7s} {'vs bf16':>8s} {'vs comp':>8s}"
    )
    print(header)
    print("-" * len(header))
    for name, r in results.items():
        if "error" in r:
            print(f"{name:20s} ERROR {r['error']}")
            continue
        base = results.get("plain-bf16/var" if name.endswith("/var") else "plain-bf16", {})
        ratio = r["tokens_per_s"] / base["tokens_per_s"] if base.get("tokens_per_s") else float("nan")
        compiled = results.get(
            "plain-bf16+compile/var" if name.endswith("/var") else "plain-bf16+compile", {}
        )
        vs_compiled = (
            r["tokens_per_s"] / compiled["tokens_per_s"] if compiled.get("tokens_per_s") else float("nan")
        )
        pad = 1 - r["tokens"] / r["padded_tokens"]
        print(
            f"{name:20s} {r['attn']:13s} {r['tokens']:7d} {pad:5.0%} {r['micro_batches']:3d} {r['step_s']:8.3f} "
            f"{r['tokens_per_s']:9.0f} {r['tflops']:8.1f} {r['mfu']:6.1%} {r.get('mfu_measured', float('nan')):6.1%} "
            f"{r['peak_mem_gb']:7.1f} {ratio:8.2f} {vs_compiled:8.2f}"
        )
    measured = [r["peak_tflops_measured"] for r in results.values() if "peak_tflops_measured" in r]
    if measured:
        print(
            f"MFU against the nominal peak (--peak-tflops {args.peak_tflops:g}); MFUm against the GEMM peak "
            f"measured on this device: {statistics.median(measured):.1f} TFLOP/s"
        )
    for name, r in results.items():
        if len(r.get("rounds_tokens_per_s", [])) > 1:
            print(f"{name}: tok/s per round {' '.join(f'{x:.0f}' for x in r['rounds_tokens_per_s'])}")
    for name, (per_round, median) in packed_vs_padded(results).items():
        print(
            f"{name}: packed/padded tok/s per round {' '.join(f'{x:.3f}' for x in per_round)}; median {median:.3f}"
        )
    for name, r in results.items():
        if "packed_vs_padded_max_abs_dlogp" in r:
            print(f"{name}: packed vs padded log-probs, max |diff| {r['packed_vs_padded_max_abs_dlogp']:.3g}")
        if "full_state_s" in r:
            print(f"{name}: named_weights() streamed {r['full_state_gb']:.2f} GB in {r['full_state_s']:.2f}s")


if __name__ == "__main__":
    sys.exit(main())
