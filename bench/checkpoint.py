"""What the rolling checkpoint costs a learner step (rlbus.learner.rolling_checkpoint), side by side in one run.

The same PolicyTrainer and batch as bench/learner.py (the 0.5B Qwen2 shape by default, `--tiny` for a toy):
one checkpoint staged and written by hand (its sizes and seconds), then rounds of N plain steps and N steps
with the learner's rolling checkpoint at `--budget` (staged to host memory when due, the previous write
awaited first, the new one written in a background thread). Prints the mean step both ways, their ratio,
and how many steps apart the checkpoints landed: at most that many steps a learner restart retrains.

    python bench/checkpoint.py                       # the 0.5B shape (on a GPU)
    python bench/checkpoint.py --tiny --device cpu   # smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import learner as bench_learner  # noqa: E402  (bench/learner.py: the model, batch and config builders)


async def timed_steps(trainer, batch, steps: int, rolling=None) -> tuple[list[float], list[float]]:
    """Seconds of each step (with the rolling checkpoint's share when `rolling`), and what each step paid it."""
    paid: list[float] = []
    times: list[float] = []
    for i in range(steps):
        t0 = time.perf_counter()
        trainer.train_step(batch)
        bench_learner._sync()
        step_s = time.perf_counter() - t0
        if rolling is not None:
            paid.append(await rolling.after_step(i + 1, step_s, trainer, lambda i=i: {"step": i + 1}, None))
        times.append(time.perf_counter() - t0)
    return times, paid


async def measure(args: argparse.Namespace) -> int:
    from rlbus.learner.rolling_checkpoint import RollingCheckpointer, stage, write
    from rlbus.learner.trainer import PolicyTrainer
    from rlbus.logs import get_logger

    config = bench_learner.model_config(args)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        model_dir = bench_learner.build_model_dir(config, Path(tmp) / "model")
        lengths = [args.seq_len] * args.batch
        batch = bench_learner.make_batch(lengths, config.vocab_size, args.prompt_len, args.group)
        cfg = bench_learner.rlbus_config(model_dir, args, "rlbus")
        trainer = PolicyTrainer(cfg, model_dir, bench_learner.this_device(args), total_steps=1000)
        for _ in range(args.warmup):
            trainer.train_step(batch)
        bench_learner._sync()
        rolling = RollingCheckpointer(
            Path(tmp) / "ckpt", args.budget, 1, lambda step: False, get_logger("bench")
        )
        t0 = time.perf_counter()  # one checkpoint by hand: the host buffers exist, and what a write costs
        staged = stage(Path(tmp) / "ckpt" / "step_0", trainer, {"step": 0}, None, rolling.host)
        first_stage_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        staged = stage(Path(tmp) / "ckpt" / "step_0", trainer, {"step": 0}, None, rolling.host)
        stage_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        write(staged)
        write_s = time.perf_counter() - t0
        state_gb = sum(t.numel() * t.element_size() for t in rolling.host._by_key.values()) / 1e9  # noqa: SLF001
        print(
            f"{state_gb:.2f} GB of model and optimizer state: staging {stage_s:.3f} s (the first, allocating "
            f"pinned buffers, {first_stage_s:.3f} s), writing {write_s:.2f} s in the background",
            flush=True,
        )
        rows = []
        for r in range(args.rounds):  # plain, then with the rolling checkpoint at the budget, in turn
            plain, _ = await timed_steps(trainer, batch, args.steps)
            written = rolling.written
            with_ckpt, paid = await timed_steps(trainer, batch, args.steps, rolling)
            await rolling.flush()
            staged_n = sum(p > 0 for p in paid)
            rows.append(
                (statistics.mean(plain), statistics.mean(with_ckpt), staged_n, rolling.written - written)
            )
            print(
                f"round {r + 1}: mean step {rows[-1][0]:.3f} s plain, {rows[-1][1]:.3f} s with the rolling "
                f"checkpoint at budget {args.budget:g} ({staged_n} staged in {args.steps} steps, paying "
                f"{', '.join(f'{p:.3f}' for p in paid if p > 0) or 'nothing'} s)",
                flush=True,
            )
        plain_s = statistics.median(r[0] for r in rows)
        ckpt_s = statistics.median(r[1] for r in rows)
        staged_total = sum(r[2] for r in rows)
        every = args.steps * args.rounds / max(staged_total, 1)
        print(
            f"\nrolling checkpoint at trainer.rolling_checkpoint_budget={args.budget:g}: mean step {plain_s:.3f} s "
            f"plain, {ckpt_s:.3f} s with it: {ckpt_s / plain_s:.3f}x ({(ckpt_s - plain_s) / plain_s:+.1%}); "
            f"one every {every:.1f} steps, so a learner restart retrains at most about that many; staging alone "
            f"is {stage_s / plain_s:.1%} of a step, the write {write_s / plain_s:.1f} steps long"
        )
        return 0 if math.isfinite(ckpt_s / plain_s) else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--batch", type=int, default=16, help="sequences per step")
    p.add_argument("--micro", type=int, default=4, help="sequences per micro-batch")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--steps", type=int, default=40, help="timed steps per side and round")
    p.add_argument("--rounds", type=int, default=3, help="plain then checkpointed, this many times in turn")
    p.add_argument("--budget", type=float, default=0.05, help="trainer.rolling_checkpoint_budget")
    p.add_argument("--dir", default=None, help="where the checkpoints are written (a temporary folder)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="a 2-layer toy model (smoke test)")
    args = p.parse_args(argv)
    bench_learner.bootstrap_rlbus()
    return asyncio.run(measure(args))


if __name__ == "__main__":
    raise SystemExit(main())
