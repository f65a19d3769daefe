"""What the rolling checkpoint costs a learner step (rlbus.learner.rolling_checkpoint), side by side in one run.

The same PolicyTrainer and batch as bench/learner.py (the 0.5B Qwen2 shape by default, `--tiny` for a toy),
timed for N plain steps, then for N steps each followed by a rolling checkpoint (staged to host memory, the
previous write awaited first, the new one written in a background thread) as the learner does with
`trainer.rolling_checkpoint_budget=1` (every step). Prints the median step both ways, their ratio, the staging
and writing seconds, and how often the default budget (5% of a step) stages on this shape, that is how many
steps a learner restart retrains at most.

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


async def timed_steps(
    trainer, batch, steps: int, rolling=None, tokenizer=None
) -> tuple[list[float], list[float]]:
    """Seconds of each step (with the rolling checkpoint's share when `rolling`), and what staging cost."""
    paid: list[float] = []
    times: list[float] = []
    for i in range(steps):
        t0 = time.perf_counter()
        trainer.train_step(batch)
        bench_learner._sync()
        step_s = time.perf_counter() - t0
        if rolling is not None:
            paid.append(
                await rolling.after_step(i + 1, step_s, trainer, lambda i=i: {"step": i + 1}, tokenizer)
            )
        times.append(time.perf_counter() - t0)
    return times, paid


async def measure(args: argparse.Namespace) -> int:
    from rlbus.learner.rolling_checkpoint import RollingCheckpointer, rolling_due
    from rlbus.learner.trainer import PolicyTrainer
    from rlbus.logs import get_logger

    config = bench_learner.model_config(args)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = bench_learner.build_model_dir(config, Path(tmp) / "model")
        lengths = [args.seq_len] * args.batch
        batch = bench_learner.make_batch(lengths, config.vocab_size, args.prompt_len, args.group)
        cfg = bench_learner.rlbus_config(model_dir, args, "rlbus")
        trainer = PolicyTrainer(cfg, model_dir, bench_learner.this_device(args), total_steps=1000)
        for _ in range(args.warmup):
            trainer.train_step(batch)
        bench_learner._sync()
        rounds = []
        for r in range(args.rounds):
            plain, _ = await timed_steps(trainer, batch, args.steps)
            root = Path(tmp) / f"checkpoints-{r}"
            rolling = RollingCheckpointer(root, 1.0, 1, lambda step: False, get_logger("bench"))
            with_ckpt, paid = await timed_steps(trainer, batch, args.steps, rolling)
            t0 = time.perf_counter()
            await rolling.flush()
            tail_write = time.perf_counter() - t0
            rounds.append(
                (statistics.median(plain), statistics.median(with_ckpt), statistics.median(paid[1:] or paid))
            )
            print(
                f"round {r + 1}: step {rounds[-1][0]:.3f} s plain, {rounds[-1][1]:.3f} s with a rolling checkpoint "
                f"every step (staging {rounds[-1][2]:.3f} s, last write awaited {tail_write:.3f} s more)",
                flush=True,
            )
        plain_s = statistics.median(r[0] for r in rounds)
        ckpt_s = statistics.median(r[1] for r in rounds)
        stage_s = statistics.median(r[2] for r in rounds)
        state_gb = (
            sum(
                t.numel() * t.element_size()
                for t in rolling.host._by_key.values()  # noqa: SLF001 - what was staged
            )
            / 1e9
        )
        every = next(k for k in range(1, 10_000) if rolling_due(k, stage_s, plain_s, 0.05))
        print(
            f"\nrolling checkpoint, {state_gb:.2f} GB of model and optimizer state staged per checkpoint:\n"
            f"  step {plain_s:.3f} s plain, {ckpt_s:.3f} s with one every step: {ckpt_s / plain_s:.3f}x "
            f"({(ckpt_s - plain_s) / plain_s:+.1%})\n"
            f"  staging {stage_s:.3f} s = {stage_s / plain_s:.1%} of a step; at the default budget (5%) a "
            f"rolling checkpoint every {every} step(s), so a restart retrains at most {every} step(s)"
        )
        if not math.isfinite(ckpt_s / plain_s):
            return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--batch", type=int, default=16, help="sequences per step")
    p.add_argument("--micro", type=int, default=4, help="sequences per micro-batch")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--steps", type=int, default=6, help="timed steps per side and round")
    p.add_argument("--rounds", type=int, default=3, help="plain then checkpointed, this many times in turn")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="a 2-layer toy model (smoke test)")
    args = p.parse_args(argv)
    bench_learner.bootstrap_rlbus()
    return asyncio.run(measure(args))


if __name__ == "__main__":
    raise SystemExit(main())
