"""The embedded engine's decode shapes: one row bucket (two with rollout.decode_small_bucket) and one cache
length, so nothing compiles mid-run."""

from __future__ import annotations

from rlbus.rollout.engines.decode_shapes import bucket_width, plan_decode_shapes


def test_every_batch_pads_to_a_full_fetch_by_default() -> None:
    shapes = plan_decode_shapes(512, 100, 128)
    assert shapes.row_buckets == (512,)
    assert shapes.cache_len == 128 + 128  # the prompt limit rounded up to 32, then the response budget
    assert [shapes.rows_for(r) for r in (1, 64, 512, 513)] == [512, 512, 512, None]


def test_a_full_fetch_and_an_eighth_of_it_share_the_run_length_cache() -> None:
    shapes = plan_decode_shapes(512, 100, 128, small_bucket=True)
    assert shapes.row_buckets == (64, 512)
    assert shapes.cache_len == 128 + 128
    assert [shapes.rows_for(r) for r in (1, 64, 65, 120, 512, 513)] == [64, 64, 512, 512, 512, None]


def test_every_prompt_within_the_limits_fits_and_a_longer_one_does_not() -> None:
    shapes = plan_decode_shapes(64, 100, 128)
    assert all(shapes.fits(width, 128) for width in range(1, 101))
    assert shapes.fits(100, 1) and not shapes.fits(129, 128) and not shapes.fits(100, 129)


def test_small_batches_have_one_bucket() -> None:
    assert plan_decode_shapes(4, 8, 8, small_bucket=True).row_buckets == (4,)
    assert plan_decode_shapes(1, 8, 8).row_buckets == (1,)
    assert bucket_width(1) == 32 and bucket_width(32) == 32 and bucket_width(33) == 64
