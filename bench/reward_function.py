"""How fast the reward service scores with a user's function (verl's `compute_score`, run in its sandbox), side by
side in one run on the same responses: one round trip to the sandbox per response with the user's file loaded
again for every call (rlbus before 2026-12-06), one round trip per response, one per group
(`FunctionScorer.score_each`), and one per chunk of groups up to 16 responses (`chunk_groups`, what the service
does). Prints responses/s of each and the ratios.

    python bench/reward_function.py                          # 64 groups x 8 responses, bench/worked_addition.py
    python bench/reward_function.py --groups 256 --n 1       # an evaluation's shape: one response a group
    python bench/reward_function.py --groups 128 --n 16 --rounds 5
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from rlbus.reward.sandbox import resolve_callable
from rlbus.reward.scorers import FunctionScorer
from rlbus.reward.service import CHUNK_SAMPLES, chunk_groups

SPEC = f"{Path(__file__).with_name('worked_addition.py')}:compute_score"


def _load_and_call(spec: str, args: tuple[Any, ...]) -> Any:
    """The sandbox's call before its worker kept the function: the user's file runs again on every call."""
    return resolve_callable(spec)(*args)


def groups_of(groups: int, n: int) -> list[list[tuple[str, str, dict[str, Any]]]]:
    """Worked-addition-like responses (about 90 characters of steps and a `#### N` line), half of them right."""
    out = []
    for g in range(groups):
        a, b = 123456 + g, 654321 + 7 * g
        meta = {"data_source": "worked_addition", "ground_truth": str(a + b), "extra_info": {"index": g}}
        steps = " ".join(f"{d}+{d}={2 * d}" for d in range(8))
        out.append([(f"{a}+{b}", f"{steps}\n#### {a + b + (i % 2)}", meta) for i in range(n)])
    return out


def timed(run: Callable[[], object], rounds: int) -> float:
    """Median seconds of `rounds` runs, after one warm-up run (the worker's start)."""
    run()
    seconds = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        run()
        seconds.append(time.perf_counter() - t0)
    return statistics.median(seconds)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--groups", type=int, default=64)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    batch = groups_of(args.groups, args.n)
    scorer = FunctionScorer(SPEC, timeout_s=10, memory_mb=4096)
    responses = args.groups * args.n
    loading = ProcessPoolExecutor(max_workers=1, mp_context=mp.get_context("spawn"))
    calls = [  # verl's compute_score(data_source, solution_str, ground_truth, extra_info), as the scorer calls it
        (meta["data_source"], response, meta["ground_truth"], meta["extra_info"])
        for group in batch
        for _, response, meta in group
    ]
    chunks = chunk_groups([len(group) for group in batch], CHUNK_SAMPLES)
    try:
        results = {
            "a round trip per response, file loaded per call": timed(
                lambda: [loading.submit(_load_and_call, SPEC, c).result() for c in calls], args.rounds
            ),
            "a round trip per response": timed(
                lambda: [scorer.score(*item) for group in batch for item in group], args.rounds
            ),
            "a round trip per group (score_each)": timed(
                lambda: [scorer.score_each(group) for group in batch], args.rounds
            ),
            f"a round trip per chunk of up to {CHUNK_SAMPLES} (the service)": timed(
                lambda: [
                    scorer.score_each([item for g in batch[r.start : r.stop] for item in g]) for r in chunks
                ],
                args.rounds,
            ),
        }
    finally:
        scorer.close()
        loading.shutdown()
    print(f"{args.groups} groups x {args.n} responses, {SPEC.split('/')[-1]}, median of {args.rounds} rounds")
    for name, seconds in results.items():
        print(f"  {name:50s} {seconds * 1e3:8.1f} ms  {responses / seconds:9.0f} responses/s")
    base, per_response, per_group, per_chunk = results.values()
    print(
        f"per group vs per response: {per_response / per_group:.1f}x; vs loaded per call: {base / per_group:.1f}x"
    )
    print(
        f"per chunk vs per group: {per_group / per_chunk:.1f}x; vs loaded per call: {base / per_chunk:.1f}x"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
