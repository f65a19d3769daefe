"""What the learner's checkpoints after each step cost it, side by side in one run: the memory checkpoint of
every step (rlbus.learner.memory_checkpoint) alone, and with the rolling disk one at `--budget`
(rlbus.learner.rolling_checkpoint): the learner's default on a GPU.

The same PolicyTrainer and batch as bench/learner.py (the 0.5B Qwen2 shape by default, `--tiny` for a toy):
one disk checkpoint staged and written by hand (its size and seconds), then rounds of N plain steps, N steps
of each side in turn and N plain steps again. Each side's mean step is paired with its round's plain mean
(the two plain runs' average, so a drift over the round hits both); it prints the ratio round by round, their
median, and all rounds together (the long-run share, where the rolling checkpoint's rare writes count).

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


async def timed_steps(trainer, batch, steps: int, checkpoints=None, splits=None) -> list[float]:
    """Seconds of each step, with what the checkpoints took after it when given (a StepCheckpoints); the
    memory checkpoint's split of each step goes to `splits`."""
    times: list[float] = []
    for i in range(steps):
        t0 = time.perf_counter()
        trainer.train_step(batch)
        bench_learner._sync()
        step_s = time.perf_counter() - t0
        if checkpoints is not None:
            done = i + 1
            await checkpoints.after_step(done, step_s, trainer, lambda done=done: {"step": done}, None, False)
            if splits is not None and checkpoints.memory is not None:
                splits.append(dict(checkpoints.memory.split))
        times.append(time.perf_counter() - t0)
    return times


def side_config(cfg, memory: bool, budget: float, shm: Path):
    """The learner's config with one side's checkpoints: the memory one every step, the rolling one at budget."""
    trainer_cfg = cfg.trainer.model_copy(
        update={
            "memory_checkpoint": "on" if memory else "off",
            "memory_checkpoint_dir": shm,
            "rolling_checkpoint_budget": budget,
        }
    )
    return cfg.model_copy(update={"trainer": trainer_cfg})


async def measure(args: argparse.Namespace) -> int:
    from rlbus.learner.rolling_checkpoint import HostBuffers, stage, write
    from rlbus.learner.step_checkpoints import StepCheckpoints
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
        host = HostBuffers()
        t0 = time.perf_counter()  # one disk checkpoint by hand: its size, and what staging and a write cost
        staged = stage(Path(tmp) / "ckpt" / "step_0", trainer, {"step": 0}, None, host)
        first_stage_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        staged = stage(Path(tmp) / "ckpt" / "step_0", trainer, {"step": 0}, None, host)
        stage_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        write(staged)
        write_s = time.perf_counter() - t0
        state_gb = sum(t.numel() * t.element_size() for t in host._by_key.values()) / 1e9  # noqa: SLF001
        del staged, host
        print(
            f"{state_gb:.2f} GB of model and optimizer state: staging on the step's thread {stage_s:.3f} s (the "
            f"first, allocating pinned buffers, {first_stage_s:.3f} s), a disk write {write_s:.2f} s",
            flush=True,
        )
        log = get_logger("bench")
        run_dir = Path(tmp) / "run"
        sides = {
            "memory": StepCheckpoints(
                side_config(cfg, True, 0.0, args.shm), run_dir, trainer, lambda s: False, log
            ),
            "memory+rolling": StepCheckpoints(
                side_config(cfg, True, args.budget, args.shm), run_dir / "both", trainer, lambda s: False, log
            ),
        }
        means: dict[str, list[float]] = {"plain": [], **{name: [] for name in sides}}
        splits: list[dict[str, float]] = []
        try:
            for name, side in sides.items():  # the slots exist before the clock starts (allocated once)
                await timed_steps(trainer, batch, 2, side)
                if side.memory is not None and side.memory.off_reason:
                    print(f"{name}: off ({side.memory.off_reason})")
                    return 1
            for r in range(args.rounds):  # plain, each side in turn, plain again: this many times
                before = statistics.mean(await timed_steps(trainer, batch, args.steps))
                for name, side in sides.items():
                    saved = side.memory.saved if side.memory else 0
                    written = side.rolling.written if side.rolling else 0
                    times = await timed_steps(
                        trainer, batch, args.steps, side, splits if name == "memory" else None
                    )
                    means[name].append(statistics.mean(times))
                    await side.flush()
                    saved = (side.memory.saved if side.memory else 0) - saved
                    written = (side.rolling.written if side.rolling else 0) - written
                    print(
                        f"round {r + 1} {name}: mean step {means[name][-1]:.3f} s "
                        f"({saved} memory checkpoints, {written} disk ones in {args.steps} steps)",
                        flush=True,
                    )
                after = statistics.mean(await timed_steps(trainer, batch, args.steps))
                means["plain"].append((before + after) / 2)
                print(f"round {r + 1} plain: mean step {before:.3f} s before the sides, {after:.3f} s after")
        finally:
            for side in sides.values():
                await side.finish()
        plain_s = statistics.median(means["plain"])
        print()
        for name in sides:
            ratios = [side_s / plain for side_s, plain in zip(means[name], means["plain"], strict=True)]
            overall = sum(means[name]) / sum(means["plain"])
            print(
                f"{name}: per round {' '.join(f'{x:.3f}' for x in ratios)} of the round's plain step; "
                f"median {statistics.median(ratios):.3f}x ({statistics.median(ratios) - 1:+.1%}), "
                f"all rounds together {overall:.3f}x"
            )
        memory = sides["memory"].memory
        if splits and memory is not None:
            parts = ", ".join(
                f"{k} {statistics.mean(d.get(k, 0.0) for d in splits) * 1e3:.1f} ms" for k in splits[-1]
            )
            print(f"memory: per step {parts}; slots pinned: {memory.pinned}")
        print(
            "memory: a learner restart (its process killed) resumes from its last step or the one before; "
            f"staging the same state on the step's thread would be {stage_s / plain_s:.1%} of a step"
        )
        return 0 if math.isfinite(plain_s) else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--batch", type=int, default=16, help="sequences per step")
    p.add_argument("--micro", type=int, default=4, help="sequences per micro-batch")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--steps", type=int, default=40, help="timed steps per side and round")
    p.add_argument(
        "--rounds", type=int, default=3, help="plain, each side, plain again: this many times in turn"
    )
    p.add_argument("--budget", type=float, default=0.05, help="trainer.rolling_checkpoint_budget")
    p.add_argument("--dir", default=None, help="where the disk checkpoints are written (a temporary folder)")
    p.add_argument("--shm", type=Path, default=Path("/dev/shm"), help="trainer.memory_checkpoint_dir")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="a 2-layer toy model (smoke test)")
    args = p.parse_args(argv)
    bench_learner.bootstrap_rlbus()
    return asyncio.run(measure(args))


if __name__ == "__main__":
    raise SystemExit(main())
