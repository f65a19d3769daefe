"""The embedded engine's decode loop alone and beside a thread that runs Python without pause, at CPython's
default GIL switch interval (5 ms) and at shorter ones.

Why: a batch's thread gives the GIL up at every torch call and, while another thread runs Python (a compile's
trace, a burst of message decoding), waits a whole switch interval to get it back (the convoy effect). This
measures how much that costs the replica's decode loop, side by side in one run, in milliseconds per batch.

    python bench/decode_beside_python.py                          # a 0.5M random model on the CPU
    python bench/decode_beside_python.py --device cuda --random-model 768:12:2048 --rows 512 --tokens 148
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from pathlib import Path

INTERVALS_S = (0.005, 0.001, 0.0001)  # CPython's default first


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--random-model", default="128:2:256", help="hidden:layers:intermediate")
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--batches", type=int, default=10, help="batches per timing")
    args = parser.parse_args()

    from rollout import build_random_model  # bench/rollout.py's: head_dim 64, Qwen2's grouped heads

    from rlbus.messages import SamplingParams
    from rlbus.rollout.engines.base import GenerationRequest
    from rlbus.rollout.engines.decode_shapes import plan_decode_shapes
    from rlbus.rollout.engines.hf import HFEngine

    model = build_random_model(args.random_model, Path(tempfile.mkdtemp(prefix="rlbus-bench-")))
    engine = HFEngine(
        model,
        dtype="bfloat16" if args.device == "cuda" else "float32",
        device=args.device,
        max_batch_rows=args.rows,
        compiled_decode=args.device == "cuda",  # on a GPU the step as the replica runs it, compiled
        static_decode=True,
        decode_shapes=plan_decode_shapes(args.rows, 32, args.tokens),
    )
    engine.warm_up(lambda _text: None)
    prompt = engine.tokenizer.encode("12+3=", add_special_tokens=False)
    batch = [GenerationRequest(prompt, args.rows, SamplingParams(temperature=1.0, max_tokens=args.tokens,
                                                                 ignore_eos=True))]  # fmt: skip

    def ms_per_batch() -> float:
        start = time.monotonic()
        for _ in range(args.batches):
            engine.generate(batch)
        return (time.monotonic() - start) / args.batches * 1000

    engine.generate(batch)
    alone = ms_per_batch()
    print(f"{'alone':>34}: {alone:8.1f} ms a batch")
    stop = threading.Event()

    def spin() -> None:  # Python without pause, as dynamo's trace or a decode of many messages runs
        total = 0
        while not stop.is_set():
            for i in range(1000):
                total += i * i

    thread = threading.Thread(target=spin, daemon=True)
    thread.start()
    default = sys.getswitchinterval()
    try:
        for interval in INTERVALS_S:
            sys.setswitchinterval(interval)
            ms = ms_per_batch()
            print(
                f"beside a Python thread, {interval * 1000:5g} ms: {ms:8.1f} ms a batch ({ms / alone:.1f}x alone)"
            )
    finally:
        stop.set()
        thread.join()
        sys.setswitchinterval(default)


if __name__ == "__main__":
    main()
