"""Checks a finished run from the outside, as an operator would: its ledger and metrics files.

    python tests/cluster/check_run.py RUN_DIR --steps N [--rises METRIC]

Exits non-zero with the reason when the ledger does not add up (a prompt neither trained nor dropped,
one trained twice, a step missing or short) or the metrics miss a step.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path


def ledger_problems(ledger: dict, steps: int) -> list[str]:
    """What is wrong with a finished run's ledger: every dispatched prompt trained once or dropped with a
    reason, and `steps` updates each trained on the same number of prompts."""
    dispatched, trained, dropped = set(ledger["dispatched"]), ledger["trained"], ledger["dropped"]
    problems = []
    if set(trained) & set(dropped):
        problems.append(f"{len(set(trained) & set(dropped))} prompts both trained and dropped")
    if dispatched != set(trained) | set(dropped):
        problems.append(f"{len(dispatched - set(trained) - set(dropped))} dispatched prompts unaccounted for")
    per_step = Counter(trained.values())  # prompt -> the policy version its update started from
    first = min(per_step, default=0)
    if sorted(per_step) != list(range(first, first + steps)):
        problems.append(f"trained in versions {sorted(per_step)}, want {steps} in a row")
    if len(set(per_step.values())) > 1:
        problems.append(f"steps trained on unequal prompt counts: {dict(per_step)}")
    indices = Counter(ledger["dispatched"][pid] for pid in trained)
    if any(n > 1 for n in indices.values()):
        problems.append("a data index was trained twice")
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument(
        "--rises", metavar="METRIC", help="e.g. reward/accuracy: last quarter's mean > first's"
    )
    args = parser.parse_args()

    ledger = json.loads((args.run_dir / "ledger.json").read_text())
    problems = ledger_problems(ledger, args.steps)
    rows = [json.loads(line) for line in (args.run_dir / "metrics.jsonl").read_text().splitlines() if line]
    train = [r for r in rows if "reward/mean" in r]
    if sorted({r["step"] for r in train}) != list(range(1, args.steps + 1)):
        problems.append(f"metrics hold steps {sorted({r['step'] for r in train})}")
    if args.rises and len(train) >= 4:
        quarter = len(train) // 4
        first = sum(r[args.rises] for r in train[:quarter]) / quarter
        last = sum(r[args.rises] for r in train[-quarter:]) / quarter
        print(f"check_run: {args.rises} first quarter {first:.3f}, last quarter {last:.3f}")
        if last <= first:
            problems.append(f"{args.rises} did not rise: {first:.3f} -> {last:.3f}")
    for p in problems:
        print(f"check_run: {args.run_dir}: {p}", file=sys.stderr)
    if not problems:
        dropped = Counter(ledger["dropped"].values())
        print(
            f"check_run: ledger adds up: {len(ledger['dispatched'])} dispatched = "
            f"{len(ledger['trained'])} trained + {len(ledger['dropped'])} dropped {dict(dropped)}"
        )
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
