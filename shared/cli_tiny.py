"""`rlbus make-tiny-model DIR`: build the tiny warm-started model (the main CLI calls this)."""

from __future__ import annotations

import argparse
import json
import sys

from rlbus.tasks import TASK_NAMES


def make_parser() -> argparse.ArgumentParser:
    from rlbus.tiny_model import DEFAULT_SFT_STEPS, DEFAULT_TARGET_SAMPLED_ACCURACY

    p = argparse.ArgumentParser(
        prog="rlbus make-tiny-model",
        description="Build a tiny character-level Qwen2 model, warm-started by a short SFT on a task.",
    )
    p.add_argument("dir", metavar="DIR", help="output directory (created if missing)")
    p.add_argument("--task", default="addition", choices=[t for t in TASK_NAMES if t != "gsm8k"])
    p.add_argument("--digits", type=int, default=2, help="operand digits (default 2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--sft-steps", type=int, default=DEFAULT_SFT_STEPS, help="most SFT steps (stops early at the target)"
    )
    p.add_argument(
        "--target-accuracy",
        type=float,
        default=DEFAULT_TARGET_SAMPLED_ACCURACY,
        help="stop SFT once sampled (T=1) val accuracy reaches this; a value > 1 runs all steps",
    )
    p.add_argument("--quiet", action="store_true", help="print only the final summary")
    return p


def make_tiny_model_command(argv: list[str]) -> int:
    args = make_parser().parse_args(argv)
    from rlbus.tiny_model import build_tiny_model

    def log(msg: str) -> None:
        if not args.quiet:
            print(msg, file=sys.stderr, flush=True)

    target = args.target_accuracy if args.target_accuracy <= 1.0 else None
    info = build_tiny_model(
        args.dir,
        task=args.task,
        digits=args.digits,
        seed=args.seed,
        sft_steps=args.sft_steps,
        target_sampled_accuracy=target,
        log=log,
    )
    summary = {k: info[k] for k in ("task", "digits", "seed", "sft_steps_done", "target_reached")}
    summary.update(
        dir=str(args.dir),
        val_accuracy_sampled_t1=info["val_accuracy_sampled_t1"],
        val_accuracy_greedy=info["val_accuracy_greedy"],
        build_seconds=info["build_seconds"],
    )
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(make_tiny_model_command(sys.argv[1:]))
