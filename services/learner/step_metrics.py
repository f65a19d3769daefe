"""The run's counters logged with every step: throughput, policy version, drops, pushes, the ledger."""

from __future__ import annotations

from typing import Protocol

from torch._dynamo.utils import counters

from rlbus.learner.dispatch import DEAD_LETTERED, REFUSED, Ledger


class PushCounters(Protocol):
    failures: int
    last_seconds: float
    last_ack_wait_seconds: float


class RollingCounters(Protocol):
    staged_total_s: float


def run_counters(
    ledger: Ledger,
    pusher: PushCounters,
    ranks: int,
    version: int,
    tokens: int,
    tokens_per_s: float,
    rolling: RollingCounters | None,
) -> dict[str, float]:
    return {
        "perf/tokens_per_s": tokens_per_s,
        "perf/step_tokens": float(tokens),
        "learner/ranks": float(ranks),
        "policy/version": float(version),
        "staleness/dropped_total": float(ledger.dropped_count("stale")),
        "dapo/filtered_total": float(ledger.dropped_count("zero_variance")),
        "weights/push_failures": float(pusher.failures),
        "weights/handoff_s": float(pusher.last_seconds),
        "weights/ack_wait_s": float(pusher.last_ack_wait_seconds),
        "prompts/dispatched": float(len(ledger.dispatched)),
        "prompts/trained": float(len(ledger.trained)),
        "prompts/leftovers": float(ledger.leftovers),
        "prompts/dead_lettered": float(ledger.dropped_count(DEAD_LETTERED)),
        "prompts/refused": float(ledger.dropped_count(REFUSED)),
        "checkpoint/rolling_stage_s_total": rolling.staged_total_s if rolling else 0.0,
        # graphs torch.compile built in this process so far: a rise after step 1 is a compile stall
        "perf/compiled_graphs": float(counters["stats"]["unique_graphs"]),
    }
