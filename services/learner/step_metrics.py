"""The run's counters logged with every step: throughput, policy version, drops, pushes, the ledger."""

from __future__ import annotations

from collections import Counter
from typing import Protocol

import numpy as np
import psutil
import torch
from torch._dynamo.utils import counters

from rlbus.learner.dispatch import DEAD_LETTERED, REFUSED, Ledger
from rlbus.messages import ReadyGroup

GB = 1024**3


class PushCounters(Protocol):
    failures: int
    last_seconds: float
    last_ack_wait_seconds: float


class RollingCounters(Protocol):
    @property
    def staged_total_s(self) -> float: ...

    @property
    def memory_paid_s(self) -> float: ...


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
        "checkpoint/memory_s_total": rolling.memory_paid_s if rolling else 0.0,
        # graphs torch.compile built in this process so far: a rise after step 1 is a compile stall
        "perf/compiled_graphs": float(compiled_graph_count()),
    }


def memory_metrics(device: torch.device) -> dict[str, float]:
    """verl's memory gauges (`perf/max_memory_allocated_gb`, `perf/max_memory_reserved_gb`: the peaks so far on
    the learner's GPU; `perf/cpu_memory_used_gb`: this process's resident memory), plus the caching allocator's
    retries so far: a retry frees every cached block and syncs, a slow step's usual cause on a shared GPU."""
    out = {"perf/cpu_memory_used_gb": psutil.Process().memory_info().rss / GB}
    if device.type == "cuda":
        stats = torch.cuda.memory_stats(device)
        out |= {
            "perf/max_memory_allocated_gb": stats.get("allocated_bytes.all.peak", 0) / GB,
            "perf/max_memory_reserved_gb": stats.get("reserved_bytes.all.peak", 0) / GB,
            "perf/alloc_retries": float(stats.get("num_alloc_retries", 0)),
        }
    return out


def compiled_graph_count() -> int:
    """Graphs torch.compile has built in this process so far."""
    return int(counters["stats"]["unique_graphs"])


def batch_metrics(groups: list[ReadyGroup], version: int) -> dict[str, float]:
    """What the step's groups say: rewards, lengths, staleness and the time each stage took on them."""
    rewards = np.array([r for g in groups for r in g.scored.rewards], dtype=np.float64)
    correct = np.array([c for g in groups for c in g.scored.correct], dtype=np.float64)
    lengths = np.array([len(s.response_ids) for g in groups for s in g.scored.trajectories.samples])
    lags = [version - g.scored.trajectories.policy_version for g in groups]
    gen = [g.scored.trajectories.timings.get("generate_s", 0.0) for g in groups]
    rew = [g.scored.trajectories.timings.get("reward_s", 0.0) for g in groups]
    errors = sum(e is not None for g in groups for e in g.scored.reward_errors)
    hist = Counter(lags)
    out = {
        "reward/mean": float(rewards.mean()),
        "reward/std": float(rewards.std()),
        "reward/accuracy": float(correct.mean()),
        "reward/errors": float(errors),
        "reward/error_rate": float(errors / max(len(rewards), 1)),
        "response/length_mean": float(lengths.mean()),
        "response/length_max": float(lengths.max()),
        "response/clip_frac": float(
            np.mean([s.finish_reason == "length" for g in groups for s in g.scored.trajectories.samples])
        ),
        "staleness/mean": float(np.mean(lags)),
        "staleness/max": float(max(lags)),
        "timing/generate_s_per_group": float(np.mean(gen)),
        "timing/reward_s_per_group": float(np.mean(rew)),
    }
    for lag, count in hist.items():
        out[f"staleness/hist_{lag}"] = float(count)
    return out
