"""verl's names for the metrics rlbus logs, written beside ours so a verl user's dashboards keep working.

Every row that goes to metrics.jsonl, TensorBoard and wandb carries both names. verl's meaning is kept: its
`critic/score/mean` is the mean sequence score (our `reward/mean`), `actor/ppo_kl` the KL between the
updated and the behaving policy, `perf/throughput` tokens per second, `timing_s/*` seconds of a step's
phases (here `gen` is the wait for generated batches: generation runs beside training). Validation's
`val-core/<data_source>/reward/mean@1` comes from the learner's validation metrics, in a row of its own at
verl's step: the number of updates the validated policy had (0 for `val_before_train`).
"""

from __future__ import annotations

from typing import Any

VERL_NAMES: dict[str, str] = {
    "reward/mean": "critic/score/mean",
    "response/length_mean": "response_length/mean",
    "response/length_max": "response_length/max",
    "response/clip_frac": "response_length/clip_ratio",
    "actor/approx_kl": "actor/ppo_kl",
    "actor/clipfrac": "actor/pg_clipfrac",
    "actor/kl": "actor/kl_loss",
    "critic/values_mean": "critic/values/mean",
    "critic/returns_mean": "critic/returns/mean",
    "perf/tokens_per_s": "perf/throughput",
    "timing/step_s": "timing_s/step",
    "timing/wait_batch_s": "timing_s/gen",
    "timing/train_s": "timing_s/update_actor",
    "timing/weight_push_s": "timing_s/update_weights",
}


def with_verl_names(metrics: dict[str, Any]) -> dict[str, Any]:
    """`metrics` plus verl's name for each metric that has one (ours kept; one already there is not replaced)."""
    out = dict(metrics)
    for ours, theirs in VERL_NAMES.items():
        if ours in metrics and theirs not in metrics:
            out[theirs] = metrics[ours]
    return out


VALIDATION_PREFIX = "val-core/"


def validation_row(metrics: dict[str, Any]) -> dict[str, Any]:
    """verl's validation metrics of `metrics`, for their own row at the validated policy's step."""
    return {k: v for k, v in metrics.items() if k.startswith(VALIDATION_PREFIX)}


def is_validation_row(row: dict[str, Any]) -> bool:
    """A row holding only verl's validation metrics (no progress line is printed for it)."""
    keys = [k for k in row if k not in ("step", "time")]
    return bool(keys) and all(k.startswith(VALIDATION_PREFIX) for k in keys)
