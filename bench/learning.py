"""Learning benchmark: held-out accuracy against wall-clock seconds, rlbus (async_level 0 and 1) beside TRL.

No weights can be downloaded here, so the model is made on the spot, seeded:
1. a Qwen2-shaped model (about 75M parameters on the GPU; `--tiny`: 0.3M) on rlbus's character tokenizer
   with a chat template, pretrained from scratch on long addition with its column steps written out
   (`worked_addition.py`), until greedy held-out accuracy reaches `--start-accuracy` (or `--pretrain-s`
   runs out), so that RL has room to improve it (`--deterministic`: with deterministic kernels, so the same
   card rebuilds the same weights, about 1.8x slower);
2. GRPO from that model with each system for the same wall-clock budget: the same parquet (verl's schema),
   the same reward (`worked_addition.compute_score`, rlbus's custom_reward_function and TRL's reward
   function), n samples at the same temperature, the same lr, batch, micro-batch (`--micro-batch`) and
   response budget, no KL, gradient
   checkpointing off, both training eager (`--learner-compile` compiles rlbus's layers), rlbus packing
   each micro-batch's sequences on a GPU as verl's GRPO examples set it (`--no-remove-padding` pads, as
   TRL does), TRL with its static cache and compiled decode, rlbus's replica generating the whole batch in
   one call as TRL does (`rollout.prompts_per_batch`), and the same update numerics: rlbus keeps fp32
   master weights in its optimizer, TRL trains fp32 weights under bf16 autocast (`--trl-precision mixed`; `bf16`
   puts TRL's weights in bf16, where AdamW's updates at these learning rates are mostly rounded away);
3. each system launched with torch.compile and Triton caches of its own, empty (`cold_compile_env`): its
   clock includes its compiles, as on a fresh machine;
4. held-out greedy accuracy on the same val set over time, evaluation time off both clocks: rlbus's own
   validation (`trainer.test_freq`; the time it held a step is taken off rlbus's clock, `rlbus_points`),
   TRL's by a callback (its evaluation time is taken off TRL's clock).

It prints both curves (also by optimizer updates: learning per update, apart from speed), the time each
system took to reach TRL's final accuracy and their ratio, the accuracy of each at TRL's last evaluation, and
writes `learning.png` and `learning.json`. `--rlbus-override KEY=VALUE` gives rlbus alone one more dotted
override (`run.gpu_sharing=mps`); it becomes part of that curve's name.

    python bench/learning.py                       # on the H200: pretrain, then 3 systems x --budget-s
    python bench/learning.py --tiny --no-trl        # CPU smoke (make test-slow): rlbus only, about a minute
    python bench/learning.py --work W --async-levels 0 --no-trl; python bench/learning.py --work W
                                                    # split over two calls: the second reuses W's model and curve

A curve read back from W is used only if it started from the same weights (their SHA-256, `fingerprint`): on
a new machine the second call pretrains again, and a model that came out different stops the bench rather
than compare systems that started apart (on 2026-12-06 two H100s pretrained to 0.312 and 0.227). TRL's
side is `learning_trl.py`.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from learning_trl import run_trl
from worked_addition import CHAT_TEMPLATE, WorkedAddition, rendered, verl_rows

BENCH = Path(__file__).resolve().parent
REWARD_FILE = BENCH / "worked_addition.py"


EVALUATION_ALLOWANCE = 0.25  # rlbus runs this share past the budget: its evaluations' holds are off its clock


@dataclass
class Curve:
    """Held-out accuracy at seconds since the system was launched."""

    name: str
    points: list[tuple[float, float]] = field(default_factory=list)
    steps: int = 0
    updates: list[int] = field(default_factory=list)  # optimizer updates behind each point's policy

    def by_updates(self) -> str:
        """The points by updates instead of seconds ("12:0.531"): learning per update, apart from speed."""
        return ", ".join(f"{u}:{acc:.3f}" for u, (_, acc) in zip(self.updates, self.points, strict=False))

    def at(self, seconds: float) -> float:
        """The last accuracy measured at or before `seconds` (nan before the first)."""
        seen = [acc for t, acc in self.points if t <= seconds]
        return seen[-1] if seen else float("nan")

    def gain(self) -> float:
        """Mean accuracy of the last two evaluations, less the first (the starting policy's)."""
        last = [acc for _, acc in self.points[1:][-2:]]
        return sum(last) / len(last) - self.points[0][1] if last else float("nan")

    def reach(self, accuracy: float) -> float | None:
        """The first time the accuracy was at least `accuracy` (None: never)."""
        return next((t for t, acc in self.points if acc >= accuracy), None)

    def behind(self, other: Curve) -> list[float]:
        """The times of `other`'s evaluations at which this curve's accuracy (its last reading by then) was
        below `other`'s: "accuracy at equal time", read at every one of them, not only at the end."""
        return [t for t, acc in other.points if not self.at(t) >= acc]  # nan (no reading yet) is behind


# ----------------------------------------------------------------------------------------------- model


def shape(args: argparse.Namespace) -> dict:
    if args.tiny:
        return {"hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                "head_dim": 32, "intermediate_size": 256}  # fmt: skip
    return {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12, "num_key_value_heads": 4,
            "head_dim": 64, "intermediate_size": 2048}  # fmt: skip


def build(args: argparse.Namespace, task: WorkedAddition, work: Path) -> tuple[Path, dict]:
    """The tokenizer (with the chat template) and a fresh model, pretrained (`pretrain`), saved to work/model."""
    import torch
    from transformers import GenerationConfig, Qwen2ForCausalLM

    from rlbus.tiny_model import make_config, make_tokenizer, save_tokenizer

    tokenizer = make_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.model_max_length = args.max_positions
    torch.manual_seed(args.seed)
    config = make_config(tokenizer, max_position_embeddings=args.max_positions, **shape(args))
    model = Qwen2ForCausalLM(config).to(args.device)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    params = sum(p.numel() for p in model.parameters())
    print(
        f"model: Qwen2 {config.hidden_size}x{config.num_hidden_layers}, {params / 1e6:.1f}M parameters",
        flush=True,
    )
    with deterministic_kernels(args.device) if args.deterministic else contextlib.nullcontext():
        info = pretrain(args, model, tokenizer, task)
    info["parameters"] = params
    out = work / "model"
    model.to(torch.float32).save_pretrained(str(out))
    info["fingerprint"] = fingerprint(out)
    save_tokenizer(tokenizer, out)
    return out, info


@contextlib.contextmanager
def deterministic_kernels(device: str) -> Iterator[None]:
    """Pretraining that rebuilds the same model on the same kind of card: a bench split over two device calls
    pretrains again in the second when the machine changed, and its curves compare only if it starts from the
    same weights (`fingerprint` checks). cuBLAS reads its workspace setting when its first handle is made, in
    the first step here; the systems launched later get the environment as it was."""
    if device != "cuda":
        yield
        return
    import torch

    before = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(False)
        if before is None:
            del os.environ["CUBLAS_WORKSPACE_CONFIG"]
        else:
            os.environ["CUBLAS_WORKSPACE_CONFIG"] = before


def fingerprint(model_dir: Path) -> str:
    """SHA-256 of the saved weights (first 16 hex digits): which pretrained model a curve started from."""
    digest = hashlib.sha256()
    for path in sorted(model_dir.glob("*.safetensors")):
        with path.open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 24), b""):
                digest.update(chunk)
    return digest.hexdigest()[:16]


def pretrain(args: argparse.Namespace, model, tokenizer, task: WorkedAddition) -> dict:
    """SFT from scratch, one fresh batch a step, AdamW with warm-up; stops at the first greedy evaluation of
    the val set at `--start-accuracy` or more, or once `--pretrain-s` seconds are spent."""
    import torch

    from rlbus.held_out import evaluate_accuracy
    from rlbus.tiny_model import collate_sft, sft_step

    val = rendered(tokenizer, task.make_examples("val", args.val_examples, seed=args.seed))
    optim = torch.optim.AdamW(model.parameters(), lr=args.pretrain_lr, betas=(0.9, 0.98), weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: min(1.0, (s + 1) / 100))
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=args.device == "cuda")
    start, step, accuracy, history = time.monotonic(), 0, 0.0, []
    while accuracy < args.start_accuracy and time.monotonic() - start < args.pretrain_s:
        step += 1
        examples = rendered(
            tokenizer, task.make_examples("train", args.pretrain_batch, seed=args.seed * 1_000_003 + step)
        )
        batch = {k: v.to(args.device) for k, v in collate_sft(tokenizer, examples).items()}
        loss = sft_step(model, batch, optim, sched, autocast)
        # every eval_every steps, and every 10 once the loss is low: accuracy jumps late (0 to 0.51 in 50
        # steps on the H100), and the pretraining should stop inside the RL's starting window
        if step % args.pretrain_eval_every == 0 or (loss.item() < 0.3 and step % 10 == 0):
            with autocast:
                accuracy = evaluate_accuracy(model, tokenizer, task, val, temperature=0.0)
            history.append({"step": step, "loss": round(loss.item(), 4), "val_greedy": accuracy})
            print(f"pretrain step {step}: loss {loss.item():.4f}, held-out greedy accuracy {accuracy:.3f} "
                  f"({time.monotonic() - start:.0f} s)", flush=True)  # fmt: skip
    seconds = time.monotonic() - start
    print(f"pretrained: {step} steps in {seconds:.0f} s, held-out greedy accuracy {accuracy:.3f}", flush=True)
    return {"steps": step, "seconds": round(seconds, 1), "val_greedy": accuracy, "history": history}


def write_data(task: WorkedAddition, args: argparse.Namespace, work: Path) -> tuple[Path, Path]:
    """train.parquet and val.parquet in verl's schema; val is the pretraining's held-out set."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    paths = []
    for split, count in (("train", args.train_examples), ("val", args.val_examples)):
        path = work / f"{split}.parquet"
        pq.write_table(
            pa.Table.from_pylist(verl_rows(task.make_examples(split, count, seed=args.seed), split)), path
        )
        paths.append(path)
    return paths[0], paths[1]


# ----------------------------------------------------------------------------------------------- rlbus


def cold_compile_env(work: Path, system: str) -> dict[str, str]:
    """The environment a system is launched with: torch.compile's and Triton's caches in a new folder of its
    own, so each system's clock includes its compiles as on a fresh machine (a system launched after another in
    the same process tree would otherwise find kernels the earlier one compiled)."""
    cache = work / "compile-cache" / system
    shutil.rmtree(cache, ignore_errors=True)
    return {**os.environ, "PYTHONUNBUFFERED": "1", "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"),
            "TRITON_CACHE_DIR": str(cache / "triton")}  # fmt: skip


def rlbus_slug(args: argparse.Namespace, level: int) -> str:
    """The name of an rlbus run's curve file and run folder: its async level, whether it packed, its
    micro-batch and any `--rlbus-override` (a curve must not be read back for a run of other settings)."""
    extra = "".join(f"-{o.replace('=', '-').replace('.', '_')}" for o in args.rlbus_override)
    return f"rlbus-a{level}" + ("-packed" if args.remove_padding else "") + f"-mb{args.micro_batch}" + extra


def run_rlbus(
    args: argparse.Namespace, model: Path, data: tuple[Path, Path], level: int, work: Path
) -> Curve:
    """`rlbus up` with verl's keys, stopped with Ctrl-C's signal once the budget is spent."""
    run_id = f"learning-{rlbus_slug(args, level).removeprefix('rlbus-')}"
    overrides = [
        f"run.id={run_id}", f"run.dir={work / 'runs'}", "trainer.logger=[console,jsonl]",
        f"data.train_files={data[0]}", f"data.val_files={data[1]}", f"data.train_batch_size={args.prompts}",
        f"data.max_prompt_length={args.max_prompt_length}", f"data.max_response_length={args.max_new_tokens}",
        f"actor_rollout_ref.model.path={model}", f"actor_rollout_ref.rollout.n={args.n}",
        f"actor_rollout_ref.rollout.temperature={args.temperature}", f"actor_rollout_ref.actor.optim.lr={args.lr}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={args.micro_batch}",
        "actor_rollout_ref.model.enable_gradient_checkpointing=false", "algorithm.adv_estimator=grpo",
        f"custom_reward_function.path={REWARD_FILE}", "custom_reward_function.name=compute_score",
        "trainer.total_training_steps=100000", f"trainer.test_freq={args.test_freq}", "trainer.val_before_train=true",
        "trainer.save_freq=-1", f"trainer.async_level={level}", f"trainer.device={args.device}",
        f"rollout.prompts_per_batch={args.prompts}", f"rollout.max_num_seqs={args.prompts * args.n}",
        f"rollout.device={args.device}", f"model.dtype={args.dtype}",
        f"actor_rollout_ref.actor.use_torch_compile={str(args.learner_compile).lower()}",
        f"actor_rollout_ref.model.use_remove_padding={str(args.remove_padding).lower()}",
        *args.rlbus_override,
    ]  # fmt: skip
    log = work / f"{run_id}.log"
    launched = time.time()  # the clock's zero, in UTC beside the command: the services' logs line up with it
    stamp = time.strftime("%H:%M:%S", time.gmtime(launched)) + f".{int(launched % 1 * 1000):03d}"
    print(f"rlbus async_level={level}, launched {stamp} UTC: rlbus up {' '.join(overrides)}", flush=True)
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "rlbus.cli", "up", *overrides], cwd=work, stdout=out,
                                stderr=subprocess.STDOUT, env=cold_compile_env(work, run_id))  # fmt: skip
        try:  # past the budget by what its evaluations may hold, as TRL runs past it by its evaluations
            proc.wait(timeout=args.budget_s * (1 + EVALUATION_ALLOWANCE))
            raise RuntimeError(f"rlbus exited {proc.returncode} before its budget; see {log}")
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGINT)  # what Ctrl-C does: every service stops cleanly
            proc.wait(timeout=120)
    rows = [json.loads(line) for line in (work / "runs" / run_id / "metrics.jsonl").read_text().splitlines()]
    points, steps, updates = rlbus_points(rows, launched, args.budget_s)
    name = f"rlbus async_level={level}" + (
        f" ({', '.join(args.rlbus_override)})" if args.rlbus_override else ""
    )
    return Curve(name, points=points, steps=steps, updates=updates)


def rlbus_points(
    rows: list[dict], launched: float, budget_s: float
) -> tuple[list[tuple[float, float]], int, list[int]]:
    """rlbus's held-out accuracy on the clock TRL's is read on, from its metrics rows, and the steps it
    trained within `budget_s` on that clock. An evaluation's point is at the start of the step whose policy it
    evaluated (TRL's: as its evaluation starts), and the time evaluations held their steps
    (`timing/validation_wait_s`) is off the clock from then on, as TRL's evaluation time is off TRL's.
    Also returns the updates behind each point's policy (step N's evaluation: N - 1)."""
    points: list[tuple[float, float]] = []
    updates: list[int] = []
    steps, held = 0, 0.0
    for row in rows:
        if "timing/step_s" not in row:  # verl's validation rows, the run's last row
            continue
        end = float(row["time"]) - launched - held
        if "val/reward_mean" in row:
            start = end - float(row["timing/step_s"])
            if start <= budget_s:
                points.append((start, float(row["val/reward_mean"])))
                updates.append(int(row["step"]) - 1)
            wait = float(row.get("timing/validation_wait_s", 0.0))
            held, end = held + wait, end - wait
        if end <= budget_s:
            steps = max(steps, int(row["step"]))
    return points, steps, updates


# ----------------------------------------------------------------------------------------------- report


def report(curves: list[Curve], pretrained: dict, work: Path, args: argparse.Namespace) -> dict:
    """The curves, time to TRL's final accuracy (else to the best system's half-way gain) and accuracy at
    TRL's last evaluation; writes learning.json and learning.png."""
    for c in curves:
        print(
            f"{c.name}: {c.steps} steps, gain {c.gain():+.3f}; "
            + ", ".join(f"{t:.0f}s {a:.3f}" for t, a in c.points)
        )
        if c.updates:
            print(f"  by updates: {c.by_updates()}")
    trl = next((c for c in curves if c.name.startswith("TRL")), None)
    summary: dict = {"pretrained": pretrained, "budget_s": args.budget_s,
                     "curves": {c.name: {"steps": c.steps, "gain": c.gain(), "points": c.points, "updates": c.updates}
                                for c in curves}}  # fmt: skip
    if trl is not None and trl.points:
        target, at = trl.points[-1][1], trl.points[-1][0]
        trl_reach = trl.reach(target)
        summary["target"] = target
        print(f"target: TRL's final held-out accuracy {target:.3f} (first reached at {trl_reach:.0f} s)")
        for c in curves:
            reach = c.reach(target)
            ratio = reach / trl_reach if reach is not None and trl_reach else None
            behind = c.behind(trl)
            summary[c.name] = {"reach_s": reach, "time_ratio_vs_trl": ratio, "accuracy_at_trl_end": c.at(at),
                               "behind_trl_at_s": behind}  # fmt: skip
            print(f"  {c.name:24s} reaches it at {'-' if reach is None else f'{reach:.0f} s':>7s}"
                  f"  ({'-' if ratio is None else f'{ratio:.2f}x'} TRL's time);"
                  f" accuracy at {at:.0f} s: {c.at(at):.3f}")  # fmt: skip
            if c is not trl:
                print(f"  {'':24s} at or above TRL at {len(trl.points) - len(behind)} of its {len(trl.points)} "
                      f"evaluations" + (f"; last behind at {behind[-1]:.0f} s" if behind else ""))  # fmt: skip
    (work / "learning.json").write_text(json.dumps(summary, indent=2))
    plot(curves, work / "learning.png", pretrained)
    print(f"wrote {work / 'learning.json'} and {work / 'learning.png'}", flush=True)
    return summary


def plot(curves: list[Curve], out: Path, pretrained: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for c in curves:
        if c.points:
            ax.step(
                [t for t, _ in c.points],
                [a for _, a in c.points],
                where="post",
                marker="o",
                ms=3,
                label=c.name,
            )
    ax.set_xlabel("wall-clock seconds since launch")
    ax.set_ylabel("held-out greedy accuracy")
    ax.set_title(
        f"GRPO on worked addition ({pretrained.get('parameters', 0) / 1e6:.0f}M model, from scratch)"
    )
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


# ----------------------------------------------------------------------------------------------- main


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiny", action="store_true", help="a 0.1M model, short problems, the CPU (CI smoke)")
    p.add_argument("--device", default=None, help="cuda (default when there is one) or cpu")
    p.add_argument("--async-levels", default="0,1")
    p.add_argument("--no-trl", action="store_true")
    p.add_argument(
        "--trl-precision",
        choices=("mixed", "bf16"),
        default="mixed",
        help="TRL's weights on a GPU: mixed = fp32 weights under bf16 autocast, updated in fp32 as rlbus's "
        "master copy is (default); bf16 = the weights in bf16, faster, small updates rounded away",
    )
    p.add_argument(
        "--budget-s", type=float, default=None, help="GRPO wall-clock seconds per system (GPU 180)"
    )
    p.add_argument("--pretrain-s", type=float, default=None, help="pretraining's cap (GPU 300)")
    p.add_argument(
        "--start-accuracy", type=float, default=None, help="pretraining stops here (GPU 0.2, tiny 0.4)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--deterministic",
        action="store_true",
        help="pretrain with deterministic kernels, so a bench split over two device calls on the same kind of "
        "card rebuilds the same model (about 1.8x slower on an H100); off, measure every system in one call",
    )
    p.add_argument(
        "--learner-compile",
        action="store_true",
        help="rlbus's learner compiles its decoder layers (its default for a model of this size); off by default "
        "here, as TRL trains eager: a compile of 20-50 s is not won back in a budget of minutes",
    )
    p.add_argument(
        "--remove-padding",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="rlbus packs each micro-batch's sequences (verl's model.use_remove_padding, set in verl's GRPO "
        "examples): default on a GPU (varlen flash attention), off on the CPU (a packed row's attention there "
        "is one dense masked product, slower than padding); TRL's GRPOTrainer has no such setting and pads",
    )
    p.add_argument("--lr", type=float, default=None, help="GRPO's learning rate, both systems")
    p.add_argument(
        "--micro-batch", type=int, default=None, help="sequences per forward/backward, both systems"
    )
    p.add_argument(
        "--rlbus-override",
        action="append",
        default=[],
        help="an extra dotted override for rlbus only (run.gpu_sharing=mps); part of its curve's name",
    )
    p.add_argument("--temperature", type=float, default=None, help="sampling temperature, both systems")
    p.add_argument("--work", default=None, help="where models, data and runs go (a temporary folder)")
    args = p.parse_args(argv)
    import torch

    gpu = torch.cuda.is_available() and not args.tiny and args.device != "cpu"
    args.device = args.device or ("cuda" if gpu else "cpu")
    tiny = args.tiny or not gpu
    defaults = dict(  # CPU smoke | H200
        budget_s=(30, 180), pretrain_s=(45, 300), start_accuracy=(0.4, 0.2), min_digits=(1, 6), max_digits=(2, 10), prompts=(16, 64), n=(8, 8),
        micro_batch=(128, 128), lr=(1e-4, 1e-5), temperature=(0.6, 1.0), test_freq=(3, 5), val_examples=(128, 256), train_examples=(4096, 65536),
        pretrain_batch=(64, 256), pretrain_lr=(2e-3, 1e-3), pretrain_eval_every=(10, 50), max_positions=(128, 512),
    )  # fmt: skip
    for key, (cpu_value, gpu_value) in defaults.items():
        if getattr(args, key, None) is None:
            setattr(args, key, cpu_value if tiny else gpu_value)
    args.max_new_tokens = WorkedAddition(args.min_digits, args.max_digits).max_new_tokens
    args.max_prompt_length = 2 * args.max_digits + 24
    args.dtype = "bfloat16" if args.device == "cuda" else "float32"
    if args.remove_padding is None:
        args.remove_padding = args.device == "cuda"
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    import tempfile

    work = Path(args.work or tempfile.mkdtemp(prefix="rlbus-learning-")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    task = WorkedAddition(args.min_digits, args.max_digits)
    data = write_data(task, args, work)
    model, pretrained = reuse_model(work) or build(args, task, work)
    (work / "model" / "pretrained.json").write_text(json.dumps(pretrained))
    weights = pretrained.get("fingerprint") or fingerprint(model)
    curves = [
        measured(
            work,
            rlbus_slug(args, int(level)),
            weights,
            lambda level=int(level): run_rlbus(args, model, data, level, work),
        )
        for level in args.async_levels.split(",")
        if level
    ]
    if not args.no_trl:
        trl = lambda: Curve(*run_trl(args, model, data, work, cold_compile_env(work, "trl")))  # noqa: E731
        curves.append(measured(work, f"trl-{args.trl_precision}-mb{args.micro_batch}", weights, trl))
    report(curves, pretrained, work, args)
    return 0


def reuse_model(work: Path) -> tuple[Path, dict] | None:
    """The model an earlier call pretrained in this `--work` folder, if any (a bench split over calls)."""
    info = work / "model" / "pretrained.json"
    if not info.exists():
        return None
    print(f"model: reusing the pretrained model in {info.parent}", flush=True)
    return info.parent, json.loads(info.read_text())


def measured(work: Path, slug: str, weights: str, run: Callable[[], Curve]) -> Curve:
    """A system's curve: measured now, or read back from an earlier call in this `--work` folder if it
    started from the same pretrained weights (`fingerprint`); a curve of other weights stops the bench."""
    path = work / f"curve-{slug}.json"
    if path.exists():
        saved = json.loads(path.read_text())
        if saved.get("model") != weights:
            raise SystemExit(
                f"{path} was measured from other pretrained weights ({saved.get('model')}, these are {weights}): "
                "the curves would not compare; measure every system again in a fresh --work folder"
            )
        print(f"{saved['name']}: reusing the curve measured earlier in {path}", flush=True)
        return Curve(
            saved["name"], [tuple(p) for p in saved["points"]], saved["steps"], saved.get("updates", [])
        )
    curve = run()
    path.write_text(json.dumps({"name": curve.name, "points": curve.points, "steps": curve.steps,
                                "updates": curve.updates, "model": weights}))  # fmt: skip
    return curve


if __name__ == "__main__":
    sys.exit(main())
