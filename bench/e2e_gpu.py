"""Same-work benchmark: `rlbus up` against TRL's GRPOTrainer, side by side in one run.

Builds a random Qwen2 locally (default: the Qwen2-0.5B shape, hidden 896 x 24 layers, intermediate 4864, on
the bundled character tokenizer), then runs each system for `--warmup + --steps` optimizer steps of the same
work: `--prompts` prompts x `--n` samples x `--max-tokens` response tokens (end tokens suppressed, so every
response runs full length), GRPO, no KL, one optimizer step per batch, the same micro-batch size. Reports
seconds per step (measured steps only), response tokens/s, mean GPU utilisation over the measured window
(NVML), weight-handoff seconds (rlbus), and the ratios.

    python bench/e2e_gpu.py                      # on the GPU: rlbus async 0/1/2, TRL default and TRL+static
    python bench/e2e_gpu.py --device cpu         # the embedded demo's tiny model and work, on the CPU
    python bench/e2e_gpu.py --device cpu --rounds 5   # every system 5 times in turn: medians, paired ratios

TRL is a bench-only extra (`pip install trl`): its GRPOTrainer runs with plain transformers generation, once
with its defaults and once with the generation speed-up rlbus's embedded engine uses (static KV cache with
compiled decode; TRL accepts `cache_implementation="static"` but builds its GenerationConfig with
`disable_compile=True`, which this bench turns off so both get the same decode path).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------------------------- setup


def build_model(out_dir: Path, hidden: int, layers: int, intermediate: int) -> Path:
    """A random Qwen2 of the given shape (head_dim 64, GQA 7:1 like Qwen2-0.5B) on the tiny tokenizer, with
    room for the prompt and 128-token responses."""
    from rlbus.tiny_model import build_random_qwen2

    kv_heads = 2 if max(1, hidden // 64) % 2 == 0 else 1
    out_dir, params = build_random_qwen2(out_dir, hidden, layers, kv_heads, intermediate, max_positions=4096)
    print(f"model: random Qwen2 {hidden}x{layers} ({params / 1e6:.0f}M parameters) in {out_dir}", flush=True)
    return out_dir


class GpuSampler:
    """Samples device-wide GPU utilisation every 100 ms (NVML) with timestamps; silent without a GPU."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(0)
            self._nvml = pynvml
        except Exception:  # noqa: BLE001 - no NVML (CPU box): utilisation is reported as '-'
            self._nvml = None

    def __enter__(self) -> GpuSampler:
        if self._nvml is not None:
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            util = self._nvml.nvmlDeviceGetUtilizationRates(self._handle).gpu
            self.samples.append((time.time(), float(util)))

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2)

    def mean(self, start: float, end: float) -> float | None:
        window = [u for t, u in self.samples if start <= t <= end]
        return statistics.fmean(window) if window else None


def summarize(
    step_times: list[float],
    warmup: int,
    tokens_per_step: float,
    sampler: GpuSampler,
    handoff: list[float] | None = None,
) -> dict[str, float | None]:
    """Step times are wall-clock instants at which steps 1..K completed; steps after `warmup` count."""
    measured = step_times[warmup:]
    if len(measured) < 2:
        raise RuntimeError(f"only {len(step_times)} steps finished; need warmup {warmup} + 2")
    start = step_times[warmup - 1] if warmup > 0 else measured[0]
    steps = len(measured) if warmup > 0 else len(measured) - 1
    s_per_step = (measured[-1] - start) / steps
    durations = [b - a for a, b in zip([start, *measured], measured, strict=False)][-steps:]
    return {
        "s_per_step": s_per_step,
        "tokens_per_s": tokens_per_step / s_per_step,
        "gpu_util": sampler.mean(start, measured[-1]),
        "handoff_s": statistics.median(handoff) if handoff else None,
        "p50_step_s": percentile(durations, 50),
        "p99_step_s": percentile(durations, 99),
    }


def warm_steps(warmup: int, compiled_graphs: list[float], system: str) -> int:
    """At least `warmup` steps, and every step up to the last that compiled a graph (the learner's or TRL's
    torch.compile count after each step): a compile stall is never measured as a step."""
    compiling = [
        i + 1
        for i in range(len(compiled_graphs))
        if compiled_graphs[i] > (compiled_graphs[i - 1] if i else 0)
    ]
    warm = max(warmup, compiling[-1] if compiling else 0)
    if warm > warmup:
        print(f"  {system}: step {warm} still compiled, so the warm-up runs to it", flush=True)
    return warm


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile by linear interpolation (numpy's default), without numpy in the TRL child."""
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo, hi = int(pos), min(int(pos) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


# ----------------------------------------------------------------------------------------------- rlbus


def run_rlbus(
    args: argparse.Namespace, model_dir: Path | None, async_level: int, work: Path, round_index: int = 0
) -> dict:
    run_id = f"bench-a{async_level}" + (f"-r{round_index}" if round_index else "")
    total = args.warmup + args.steps
    overrides = [
        f"run.id={run_id}",
        f"run.dir={work / 'runs'}",
        "trainer.logger=[jsonl]",
        f"trainer.total_training_steps={total}",
        "trainer.test_freq=-1",
        "trainer.val_before_train=false",
        f"trainer.async_level={async_level}",
        f"data.train_batch_size={args.prompts}",
        f"rollout.n={args.n}",
        f"data.max_response_length={args.max_tokens}",
        "rollout.ignore_eos=true",
        f"rollout.prompts_per_batch={args.prompts}",
        f"rollout.max_num_seqs={args.prompts * args.n}",
        f"actor.ppo_micro_batch_size={args.micro_batch}",
        f"actor.optim.lr={args.lr}",
        f"rollout.temperature={args.temperature}",
        f"trainer.device={args.device}",
        f"rollout.device={args.device}",
        "trainer.save_freq=-1",
        f"model.enable_gradient_checkpointing={'true' if args.gradient_checkpointing else 'false'}",
        *args.rlbus_override,
    ]
    if model_dir is not None:
        overrides += [f"model.path={model_dir}", f"model.dtype={args.dtype}"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    print(f"rlbus async_level={async_level}: rlbus up {' '.join(overrides)}", flush=True)
    with GpuSampler() as sampler:
        done = subprocess.run(
            [sys.executable, "-m", "rlbus.cli", "up", *overrides],
            cwd=work,
            env=env,
            capture_output=True,
            text=True,
            timeout=args.timeout,
        )
    rows = [json.loads(line) for line in (work / "runs" / run_id / "metrics.jsonl").read_text().splitlines()]
    if done.returncode != 0:
        raise RuntimeError(f"rlbus exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    rows = [r for r in rows if "timing/step_s" in r]
    times = [float(r["time"]) for r in rows]
    warmup = warm_steps(args.warmup, [float(r.get("perf/compiled_graphs", 0)) for r in rows], "rlbus")
    handoff = [float(r["timing/weight_push_s"]) for r in rows[warmup:]]
    out = summarize(times, warmup, args.prompts * args.n * args.max_tokens, sampler, handoff)
    out["train_s"] = statistics.median(float(r["timing/train_s"]) for r in rows[warmup:])
    for key in ("weights/handoff_s", "weights/ack_wait_s"):  # the push's parts (medians), for the note
        values = [float(r[key]) for r in rows[warmup:] if key in r]
        if values:
            print(f"  {key}: {statistics.median(values):.4f} s", flush=True)
    print_step_parts(rows[warmup:], args.prompts)
    return out


def print_step_parts(rows: list[dict], groups: int) -> None:
    """Where each measured step went: the learner's training, its wait for the batch, the replicas' generation
    of a step's groups (the GPU's other user at async_level=1) and the push: so a slow step says which part
    was slow (an allocator retry frees the GPU's cached blocks and syncs)."""
    parts = {"train": "timing/train_s", "wait": "timing/wait_batch_s", "push": "timing/weight_push_s"}
    print(
        "  step s = train + wait for the batch + push (+ the rest); generation s in the replicas:", flush=True
    )
    for r in rows:
        values = " ".join(f"{name} {float(r.get(key, float('nan'))):.3f}" for name, key in parts.items())
        generation = float(r.get("timing/generate_s_per_group", float("nan"))) * groups
        retries = (
            f"; allocator retries so far {int(r['perf/alloc_retries'])}" if "perf/alloc_retries" in r else ""
        )
        print(f"    step {int(r.get('step', 0))}: {float(r['timing/step_s']):.3f} = {values}; generation "
              f"{generation:.3f}{retries}", flush=True)  # fmt: skip


# ----------------------------------------------------------------------------------------------- TRL


def prompts_text(count: int, seed: int = 0) -> list[str]:
    import random

    rng = random.Random(seed)
    return [f"{rng.randint(10, 99)}+{rng.randint(10, 99)}=" for _ in range(count)]


def trl_child(spec: dict) -> None:
    """Runs in its own process (the GPU is free again after it): GRPOTrainer on the same work."""
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    def reward_first_char_is_digit(completions, **_kw):  # cheap, like rlbus's rule verifier
        return [float(c[:1].isdigit()) for c in completions]

    from torch._dynamo.utils import counters

    times: list[float] = []
    graphs: list[float] = []

    class StepClock(TrainerCallback):
        def on_step_end(self, *_a, **_kw):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            times.append(time.time())
            graphs.append(float(counters["stats"]["unique_graphs"]))

    total = spec["warmup"] + spec["steps"]
    gen_kwargs = {"min_new_tokens": spec["max_tokens"]}
    config = GRPOConfig(
        output_dir=spec["out"],
        per_device_train_batch_size=spec["micro_batch"],
        gradient_accumulation_steps=spec["prompts"] * spec["n"] // spec["micro_batch"],
        num_generations=spec["n"],
        max_completion_length=spec["max_tokens"],
        learning_rate=spec["lr"],
        beta=0.0,
        temperature=spec["temperature"],
        max_steps=total,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        bf16=spec["dtype"] == "bfloat16",
        use_cpu=spec["device"] == "cpu",
        generation_kwargs=gen_kwargs,
        cache_implementation="static" if spec["static"] else None,
        gradient_checkpointing=spec["gradient_checkpointing"],  # as rlbus: off unless asked for everyone
        seed=0,
        dataloader_num_workers=0,
    )
    dataset = Dataset.from_dict({"prompt": prompts_text(spec["prompts"] * (total + 1))})
    dtype = torch.bfloat16 if spec["dtype"] == "bfloat16" else torch.float32
    from transformers import AutoModelForCausalLM

    from rlbus.modeling import load_tokenizer

    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=dtype)
    tokenizer = load_tokenizer(spec["model"])  # as rlbus loads it (AutoTokenizer picks Qwen2's class here)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward_first_char_is_digit,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[StepClock()],
    )
    if spec["static"]:
        trainer.generation_config.disable_compile = False  # the compiled static-cache decode rlbus uses
    trainer.train()
    Path(spec["times"]).write_text(json.dumps({"times": times, "compiled_graphs": graphs}))


def run_trl(
    args: argparse.Namespace, model_dir: Path, static: bool, work: Path, round_index: int = 0
) -> dict:
    out = work / (("trl-static" if static else "trl") + (f"-r{round_index}" if round_index else ""))
    spec = {
        "out": str(out),
        "times": str(out / "times.json"),
        "model": str(model_dir),
        "static": static,
        "warmup": args.warmup,
        "steps": args.steps,
        "prompts": args.prompts,
        "n": args.n,
        "max_tokens": args.max_tokens,
        "micro_batch": args.micro_batch,
        "lr": args.lr,
        "temperature": args.temperature,
        "dtype": args.dtype,
        "device": args.device,
        "gradient_checkpointing": args.gradient_checkpointing,
    }
    out.mkdir(parents=True, exist_ok=True)
    print(f"TRL GRPOTrainer ({'static cache, compiled decode' if static else 'defaults'})", flush=True)
    with GpuSampler() as sampler:
        done = subprocess.run(
            [sys.executable, __file__, "--trl-child", json.dumps(spec)],
            cwd=work,
            capture_output=True,
            text=True,
            timeout=args.timeout,
        )
    if done.returncode != 0:
        raise RuntimeError(f"TRL exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    clock = json.loads(Path(spec["times"]).read_text())
    warmup = warm_steps(args.warmup, clock["compiled_graphs"], "TRL")
    return summarize(clock["times"], warmup, args.prompts * args.n * args.max_tokens, sampler)


# ----------------------------------------------------------------------------------------------- main


def run_round(  # noqa: PLR0913
    args: argparse.Namespace, model_dir: Path | None, trl_model: Path, work: Path, gpu: bool, round_index: int
) -> dict:
    """Each system once: rlbus at each async level, then TRL (with its defaults; on CUDA also static cache)."""
    results: dict[str, dict] = {}
    for level in (int(x) for x in args.async_levels.split(",") if x):
        results[f"rlbus async_level={level}"] = run_rlbus(args, model_dir, level, work, round_index)
        print(table(results, None), flush=True)
    if not args.no_trl:
        for name, static in (("TRL defaults", False), ("TRL + static cache", True)):
            if (static and not gpu) or ("static" if static else "defaults") not in args.trl_variants:
                continue
            try:
                results[name] = run_trl(args, trl_model, static, work, round_index)
            except (RuntimeError, subprocess.TimeoutExpired) as exc:  # the table of what did run still prints
                print(f"{name} failed: {str(exc)[-2000:]}", flush=True)
    return results


def median_results(rounds: list[dict[str, dict]]) -> dict[str, dict]:
    """Per system, the round whose s/step is the median (the lower middle one for an even count)."""
    out: dict[str, dict] = {}
    for name in rounds[0]:
        runs = sorted((rd[name] for rd in rounds if name in rd), key=lambda r: r["s_per_step"])
        out[name] = runs[(len(runs) - 1) // 2]
    return out


def table(results: dict[str, dict], base: str | None) -> str:
    def fmt(v, spec):
        return format("-", spec[:3]) if v is None else format(v, spec)

    lines = [
        f"{'system':<22} {'s/step':>8} {'p50 s':>7} {'p99 s':>7} {'resp tok/s':>11} {'GPU util %':>10} "
        f"{'handoff s':>10} {'vs ' + (base or '-'):>14}"
    ]
    for name, r in results.items():
        ratio = results[base]["s_per_step"] / r["s_per_step"] if base in results else None
        lines.append(
            f"{name:<22} {r['s_per_step']:>8.3f} {r['p50_step_s']:>7.3f} {r['p99_step_s']:>7.3f} "
            f"{r['tokens_per_s']:>11.0f} {fmt(r['gpu_util'], '>10.0f')} "
            f"{fmt(r['handoff_s'], '>10.4f')} {fmt(ratio, '>13.2f')}x"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--hidden", type=int, default=896)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--intermediate", type=int, default=4864)
    p.add_argument("--prompts", type=int, default=None, help="prompts per step (cuda 64, cpu 16)")
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=None, help="response tokens (cuda 128, cpu 8)")
    p.add_argument(
        "--micro-batch", type=int, default=None, help="sequences per forward/backward (cuda 64, cpu 128)"
    )
    p.add_argument("--steps", type=int, default=8, help="measured steps")
    p.add_argument("--warmup", type=int, default=3, help="steps not measured (compilation, first push)")
    p.add_argument(
        "--async-levels",
        default="0,1",
        help="0 is the equal-algorithm row (on-policy, as TRL); 1 trains one behind",
    )
    p.add_argument(
        "--gradient-checkpointing",
        action="store_true",
        help="on for every system (default: off for all of them)",
    )
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--no-trl", action="store_true")
    p.add_argument(
        "--trl-variants",
        default="defaults,static",
        help="TRL's runs: defaults (its own generation), static (static cache, compiled decode: cuda only)",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="run every system this many times, in turn (medians; default 3 on cuda, 1 on cpu)",
    )
    p.add_argument("--timeout", type=float, default=900, help="per system (first compile included)")
    p.add_argument("--rlbus-override", action="append", default=[], help="extra dotted override for rlbus")
    p.add_argument("--trl-child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.trl_child:
        trl_child(json.loads(args.trl_child))
        return 0
    gpu = args.device == "cuda"
    args.rounds = args.rounds or (3 if gpu else 1)
    args.prompts = args.prompts or (64 if gpu else 16)
    args.max_tokens = args.max_tokens or (128 if gpu else 8)
    args.micro_batch = args.micro_batch or (64 if gpu else args.prompts * args.n)
    args.dtype = "bfloat16" if gpu else "float32"
    work = Path(tempfile.mkdtemp(prefix="rlbus-e2e-"))
    if gpu:
        model_dir: Path | None = build_model(work / "model", args.hidden, args.layers, args.intermediate)
        trl_model = model_dir
    else:
        from rlbus.model_source import resolve_model_path

        model_dir, trl_model = None, resolve_model_path(None)  # the embedded demo's own model
        print(f"model: the embedded demo's tiny model ({trl_model})", flush=True)
    print(
        f"work per step: {args.prompts} prompts x {args.n} samples x {args.max_tokens} tokens, micro-batch "
        f"{args.micro_batch}, {args.warmup} warm-up + {args.steps} measured steps, {time.strftime('%Y-%m-%d')}",
        flush=True,
    )
    rounds: list[dict[str, dict]] = []
    for r in range(args.rounds):  # every system once per round, in turn: a slow spell of the box hits both
        if args.rounds > 1:
            print(f"round {r + 1}/{args.rounds}", flush=True)
        rounds.append(run_round(args, model_dir, trl_model, work, gpu, r))
    results = median_results(rounds)
    base = next((b for b in ("TRL + static cache", "TRL defaults") if b in results), None)
    if args.rounds > 1 and base:
        for name in (n for n in results if n.startswith("rlbus")):
            pairs = [
                (rd[name]["s_per_step"], rd[base]["s_per_step"]) for rd in rounds if name in rd and base in rd
            ]
            print(f"{name} s/step / {base} s/step, round by round:", flush=True)
            for i, (ours, theirs) in enumerate(pairs, 1):
                print(f"  round {i}: {ours:.3f} / {theirs:.3f} = {ours / theirs:.2f}", flush=True)
            print(f"  median ratio {statistics.median(a / b for a, b in pairs):.2f}", flush=True)
    print()
    print(table(results, base))
    if "TRL + static cache" in results:
        ref = results["TRL + static cache"]["s_per_step"]
        for name, r in results.items():
            if name.startswith("rlbus"):
                print(f"{name}: {ref / r['s_per_step']:.2f}x TRL + static cache")
    if "rlbus async_level=0" in results:
        print(
            "equal-algorithm row: rlbus async_level=0 (on-policy, as TRL is); async_level=1 trains one version behind"
        )
    gc = "on" if args.gradient_checkpointing else "off"
    print(f"gradient checkpointing {gc} for every system; p99/p50 step time after warm-up:")
    for name, r in results.items():
        print(f"  {name}: {r['p99_step_s'] / r['p50_step_s']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
