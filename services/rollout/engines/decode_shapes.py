"""The few shapes the embedded engine's compiled decode step runs at, decided once when the replica starts.

transformers compiles the decode step per (rows, KV-cache length), and a new pair mid-run stalls a step for
the seconds a compile takes (a 15-prompt partial fetch, a validation batch, a longer prompt). The engine pads
each batch to a row bucket and gives every bucket one static cache of the run's whole length (longest prompt
bucket + longest response), so the prompt's width only changes the prefill, which is not compiled. The
replica compiles each bucket at start (`HFEngine.warm_up`); nothing compiles after it.

One bucket, a fetch's rows, by default: on an H100 (2026-12-06) a second bucket of an eighth of them cost
12.3 s of compile at start on a 74M model of the learning bench's shape and 22.9 s on the 0.5B shape, while it
serves only validation and partial fetches, and padding one of those to the fetch's rows costs at most a full
batch's decode (0.28 s and 0.4 s there).
"""

from __future__ import annotations

from dataclasses import dataclass

from rlbus.modeling import round_up

WIDTH_STEP = 32  # prompt widths are rounded up to this (left padding is masked, so it changes nothing)
SMALL_BUCKET_SHARE = 8  # the small bucket is this share of the large one: validation and partial fetches


def bucket_width(width: int, step: int = WIDTH_STEP) -> int:
    """Prompt width rounded up to a multiple of `step`."""
    return round_up(width, step)


@dataclass(frozen=True)
class DecodeShapes:
    """Row buckets (ascending) and the static cache's length every bucket shares."""

    row_buckets: tuple[int, ...]
    cache_len: int

    def rows_for(self, rows: int) -> int | None:
        """The smallest bucket that holds `rows` (None: more rows than the largest)."""
        return next((b for b in self.row_buckets if b >= rows), None)

    def fits(self, width: int, max_tokens: int) -> bool:
        """Whether a prompt of `width` (bucketed) and `max_tokens` new tokens fit the static cache."""
        return bucket_width(width) + max_tokens <= self.cache_len


def plan_decode_shapes(
    max_batch_rows: int, max_prompt_tokens: int, max_response_tokens: int, small_bucket: bool = False
) -> DecodeShapes:
    """A bucket of `max_batch_rows` (a full fetch) and, with `small_bucket`, one of 1/SMALL_BUCKET_SHARE of it
    (rollout.decode_small_bucket): padding a small batch costs less than a compile per size."""
    large = max(1, max_batch_rows)
    buckets = {large, large // SMALL_BUCKET_SHARE if small_bucket else 0} - {0}
    return DecodeShapes(tuple(sorted(buckets)), bucket_width(max_prompt_tokens) + max_response_tokens)
