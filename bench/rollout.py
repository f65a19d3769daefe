"""Rollout engine benchmark: hf vs vllm on the same model, prompts and sampling, in one run.

Measures per engine: start-up, time to the first batch (includes any warm-up), steady tokens/s over the
following batches, and the cost of one weight push of the whole model through the gloo path the learner
uses (rlbus.weight_sync.WeightSender in a separate process -> engine.receive_weights). Engines run one
after the other (never side by side), so they do not compete for the CPU.

    python bench/rollout.py                      # the bundled tiny model
    python bench/rollout.py --model DIR --prompts 32 --n 4 --max-tokens 64
    python bench/rollout.py --random-model 768:12 --prompts 16 --n 4 --max-tokens 16   # 74M params, random
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path
from typing import Any


def _learner(model_dir: str, port: int, pushes: int, replies: Any) -> None:
    """Learner side of the push: plans the model's weights once, hosts the group, sends `pushes` times."""
    import torch

    from rlbus.modeling import load_causal_lm
    from rlbus.weight_sync import WeightSender

    torch.set_num_threads(1)
    try:
        model = load_causal_lm(model_dir, "float32", "cpu", trainable=False)
        named = list(model.named_parameters())
        sender = WeightSender(backend="gloo", host="127.0.0.1", timeout_s=300.0)
        plan = sender.plan(named)
        replies.put(("plan", plan.announcement_fields(), plan.total_bytes))
        sender.open(port, 2, 1)
        for _ in range(pushes):
            sender.send(named, plan)
            replies.put(("sent", sender.last_send_seconds, sender.last_send_bytes))
        sender.close()
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        replies.put(("error", repr(exc), 0))


def bench_push(engine: Any, model_dir: Path, pushes: int) -> dict[str, float]:
    """Seconds and GB/s of one full-model push (median of `pushes`), timed around receive_weights."""
    from rlbus.messages import WeightAnnouncement
    from rlbus.weight_sync import free_port

    ctx = mp.get_context("spawn")
    replies = ctx.Queue()
    port = free_port()
    proc = ctx.Process(target=_learner, args=(str(model_dir), port, pushes, replies), daemon=True)
    proc.start()
    try:
        kind, fields, total = replies.get(timeout=300)
        if kind != "plan":
            raise RuntimeError(f"learner side failed: {fields}")
        times: list[float] = []
        for version in range(1, pushes + 1):
            ann = WeightAnnouncement(
                run_id="bench",
                version=version,
                epoch=1,
                master_addr="127.0.0.1",
                master_port=port,
                world_size=2,
                ranks={"bench": 1},
                backend="gloo",
                **fields,
            )
            start = time.perf_counter()
            engine.receive_weights(ann, 1, timeout_s=300.0)
            times.append(time.perf_counter() - start)
            reply = replies.get(timeout=300)
            if reply[0] != "sent":
                raise RuntimeError(f"learner side failed: {reply[1]}")
    finally:
        proc.join(timeout=60)
        if proc.is_alive():
            proc.kill()
    first = times[0]
    steady = sorted(times[1:] or times)[len(times[1:] or times) // 2]
    return {
        "push_bytes": float(total),
        "push_first_s": first,
        "push_s": steady,
        "push_gbps": total / steady / 1e9,
    }


def build_random_model(spec: str, out_dir: Path) -> Path:
    """A random-weight Qwen2 of `HIDDEN:LAYERS[:INTERMEDIATE]` (head_dim 64, GQA 7:1 like Qwen2-0.5B where the
    heads allow, else 4:1) on the tiny character tokenizer, built locally. `896:24:4864` is the 0.5B shape."""
    from rlbus.tiny_model import build_random_qwen2

    hidden, layers, *rest = (int(x) for x in spec.split(":"))
    heads = max(1, hidden // 64)
    kv_heads = heads // 7 if heads % 7 == 0 else max(1, heads // 4) if heads % 4 == 0 else heads
    out_dir, params = build_random_qwen2(
        out_dir,
        hidden,
        layers,
        kv_heads=kv_heads,
        intermediate=rest[0] if rest else (hidden * 8 // 3 + 63) // 64 * 64,
        max_positions=4096,
    )
    print(f"random model {spec}: {params / 1e6:.1f}M parameters in {out_dir}", flush=True)
    return out_dir


def bench_engine(
    name: str, model_dir: Path, prompts: list[list[int]], args: argparse.Namespace
) -> dict[str, float]:
    from rlbus.messages import SamplingParams
    from rlbus.rollout.engines.base import GenerationRequest

    start = time.perf_counter()
    if name.startswith("hf"):
        engine: Any = _hf_engine(name, model_dir, prompts, args)
    else:
        from rlbus.rollout.engines.vllm_engine import VLLMEngine

        engine = VLLMEngine(model_dir, dtype=args.dtype, max_num_seqs=args.max_num_seqs, seed=0)
    startup = time.perf_counter() - start
    sp = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        max_tokens=args.max_tokens,
        ignore_eos=args.ignore_eos,
    )
    requests = [GenerationRequest(p, args.n, sp) for p in prompts]
    try:
        start = time.perf_counter()
        first = engine.generate(requests)
        first_s = time.perf_counter() - start
        # hf-handover: time the compiled step, which the batch after the compile takes
        compiling = getattr(engine, "background_compile", None)
        if compiling is not None:
            compiling.wait()
            engine.generate(requests)
        tokens, seconds = 0, 0.0
        for _ in range(args.batches):
            start = time.perf_counter()
            out = engine.generate(requests)
            seconds += time.perf_counter() - start
            tokens += sum(len(c.response_ids) for comps in out for c in comps)
        row = {
            "startup_s": startup,
            "first_batch_s": first_s,
            "first_batch_tokens": float(sum(len(c.response_ids) for comps in first for c in comps)),
            "tokens_per_s": tokens / seconds if seconds else 0.0,
            "mean_len": tokens / max(1, args.batches * len(prompts) * args.n),
        }
        if compiling is not None:
            row["background_compile_s"] = compiling.seconds
        if args.profile:
            row["profiled_batch_s"] = profile_batch(engine, requests)
        if args.pushes > 0:
            row.update(bench_push(engine, model_dir, args.pushes))
        return row
    finally:
        engine.close()
        del engine
        gc.collect()


def profile_batch(engine: Any, requests: list[Any]) -> float:
    """One more batch under torch.profiler: prints the kernels and host ops that take its time (where a
    decode step goes), and returns the batch's wall seconds."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        engine.generate(requests)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
    averages = prof.key_averages()
    gpu_s = sum(e.self_device_time_total for e in averages) / 1e6 if torch.cuda.is_available() else 0.0
    print(f"   profiled batch: {seconds:.3f} s wall, {gpu_s:.3f} s of GPU kernels", flush=True)
    for sort in (
        ("self_cuda_time_total", "self_cpu_time_total")
        if torch.cuda.is_available()
        else ("self_cpu_time_total",)
    ):
        print(f"   by {sort}:", flush=True)
        print(averages.table(sort_by=sort, row_limit=40, max_name_column_width=70), flush=True)
    return seconds


def round_orders(names: list[str], rounds: int) -> list[list[str]]:
    """The engines' order in each round: as given, then reversed, and so on (A B, B A, A B ...), so that
    whatever favours a place in the order favours each engine alike."""
    return [list(names) if r % 2 == 0 else list(reversed(names)) for r in range(max(1, rounds))]


def over_rounds(runs: list[dict[str, float]]) -> dict[str, Any]:
    """One engine's figures over its rounds: the first round's, with tokens/s the median of all rounds."""
    import statistics

    out: dict[str, Any] = dict(runs[0])
    speeds = [r["tokens_per_s"] for r in runs if "tokens_per_s" in r]
    if speeds:
        out["tokens_per_s"] = statistics.median(speeds)
        if len(runs) > 1:
            out["tokens_per_s_rounds"] = speeds
    return out


# engines whose decode shapes are planned
PLANNED = ("hf", "hf-recorded", "hf-handover", "hf-unfused", "hf-sdpa-decode")


def _hf_engine(name: str, model_dir: Path, prompts: list[list[int]], args: argparse.Namespace) -> Any:
    """`hf`: the replica's engine (decode shapes planned for these batches, compiled by warm_up before the
    clock starts; q/k/v and gate/up fused); `hf-recorded`: the same with its decode step's eager kernels
    recorded as CUDA graphs instead of compiled (rollout.decode_step=recorded); `hf-handover`: recorded at start
    and compiled in the background, timed once the compiled step serves (its first batch ran recorded beside
    the compile; rollout.decode_step=recorded_then_inductor); `hf-unfused`: the same without
    the fused projections;
    `hf-sdpa-decode`: `hf` with SDPA's kernels in the decode step instead of its matrix products
    (rlbus.gqa_attention); `hf-unplanned`: compiled decode through `generate` with shapes bucketed on the fly,
    unfused (the engine before shape planning); `hf-eager`: no compiled decode (rollout.enforce_eager=true)."""
    from rlbus.gqa_attention import GQA_SDPA_KERNELS
    from rlbus.rollout.engines.decode_shapes import plan_decode_shapes
    from rlbus.rollout.engines.hf import HFEngine

    rows = min(args.max_num_seqs, len(prompts) * args.n)
    shapes = plan_decode_shapes(rows, max(len(p) for p in prompts), args.max_tokens)
    engine = HFEngine(
        model_dir,
        dtype=args.dtype,
        device=args.device,
        seed=0,
        max_batch_rows=args.max_num_seqs,
        compiled_decode=False if name == "hf-eager" else None,
        decode_shapes=shapes if name in PLANNED else None,
        fuse_projections=name not in ("hf-unfused", "hf-unplanned"),
        attn_implementation=GQA_SDPA_KERNELS if name == "hf-sdpa-decode" else "sdpa",
        decode_step={"hf-recorded": "recorded", "hf-handover": "recorded_then_inductor"}.get(
            name, "inductor"
        ),
    )
    if name in PLANNED:
        engine.warm_up(lambda line: print(f"   {line}", flush=True))
    return engine


def _table(results: dict[str, dict[str, Any]]) -> str:
    cols = [
        ("startup_s", "start s", "{:.1f}"),
        ("first_batch_s", "1st batch s", "{:.3f}"),
        ("background_compile_s", "bg compile s", "{:.1f}"),
        ("tokens_per_s", "tokens/s", "{:.0f}"),
        ("mean_len", "mean len", "{:.2f}"),
        ("push_first_s", "1st push s", "{:.3f}"),
        ("push_s", "push s", "{:.4f}"),
        ("push_gbps", "push GB/s", "{:.3f}"),
    ]
    head = f"{'engine':<14}" + "".join(f"{label:>13}" for _, label, _ in cols)
    lines = [head, "-" * len(head)]
    for name, row in results.items():
        cells = "".join(f"{(fmt.format(row[k]) if k in row else '-'):>13}" for k, _, fmt in cols)
        per_round = row.get("tokens_per_s_rounds")
        rounds = f"   rounds: {', '.join(f'{v:.0f}' for v in per_round)}" if per_round else ""
        lines.append(f"{name:<14}{cells}{rounds}")
    for other in ("hf-recorded", "hf-handover", "hf-sdpa-decode", "hf-unplanned", "hf-eager"):
        if "hf" in results and other in results and results[other].get("tokens_per_s"):
            ratio = results["hf"]["tokens_per_s"] / results[other]["tokens_per_s"]
            lines.append(f"hf/{other} tokens/s ratio: {ratio:.2f}x")
    if "hf" in results and "vllm" in results:
        hf, vl = results["hf"], results["vllm"]
        ratio = vl["tokens_per_s"] / hf["tokens_per_s"] if hf.get("tokens_per_s") else float("nan")
        first = hf["first_batch_s"] / vl["first_batch_s"] if vl.get("first_batch_s") else float("nan")
        lines.append(f"vllm/hf tokens/s ratio: {ratio:.2f}x   (first batch: vllm {first:.2f}x faster)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", type=Path, default=None, help="HF model directory (default: the bundled tiny model)"
    )
    parser.add_argument(
        "--random-model",
        default=None,
        metavar="HIDDEN:LAYERS",
        help="build a random-weight Qwen2 of this shape instead of using --model",
    )
    parser.add_argument(
        "--engines",
        default="hf,vllm",
        help="any of hf, hf-recorded, hf-handover, hf-unfused, hf-sdpa-decode, hf-unplanned, hf-eager, vllm",
    )
    parser.add_argument("--prompts", type=int, default=64, help="prompts per batch")
    parser.add_argument("--n", type=int, default=8, help="samples per prompt")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--ignore-eos", action="store_true", help="every response runs to --max-tokens")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=-1)
    parser.add_argument("--batches", type=int, default=3, help="timed batches after the first")
    parser.add_argument("--pushes", type=int, default=3, help="weight pushes to time (0 = skip)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="cpu", help="hf engine device")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument(
        "--profile", action="store_true", help="profile one more batch per engine (torch.profiler)"
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run the engines this many times, the order reversed each round (the first engine of a process, "
        "or the first to compile on a machine, measured slower once: 0.71x against 1.05x reversed); tokens/s "
        "is then each engine's median, start s its first round's",
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args(argv)

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from rlbus.modeling import load_tokenizer
    from rlbus.tasks import get_task
    from rlbus.tiny_model import ensure_default_model

    if args.random_model:
        import tempfile

        model_dir = build_random_model(args.random_model, Path(tempfile.mkdtemp(prefix="rlbus-bench-")))
    else:
        model_dir = args.model or ensure_default_model()
    tok = load_tokenizer(model_dir)
    examples = get_task("addition").make_examples("val", args.prompts, seed=1)
    prompts = [tok.encode(ex.prompt, add_special_tokens=False) for ex in examples]
    print(
        f"model {model_dir} | {len(prompts)} prompts x n={args.n}, max_tokens={args.max_tokens}, "
        f"T={args.temperature} top_p={args.top_p} top_k={args.top_k} | {args.batches} timed batches | "
        f"{os.cpu_count()} CPUs",
        flush=True,
    )
    names = [e.strip() for e in args.engines.split(",") if e.strip()]
    rounds: dict[str, list[dict[str, float]]] = {name: [] for name in names}
    for r, order in enumerate(round_orders(names, args.rounds)):
        for name in order:
            print(f"-- {name}{f' (round {r + 1})' if args.rounds > 1 else ''} ...", flush=True)
            rounds[name].append(bench_engine(name, model_dir, prompts, args))
    results = {name: over_rounds(runs) for name, runs in rounds.items()}
    print()
    print(_table(results))
    if args.json:
        args.json.write_text(
            json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "results": results}, indent=2)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
