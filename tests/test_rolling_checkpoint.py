"""The rolling checkpoint's pure parts: when a step stages, and which checkpoints pruning keeps."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlbus.learner.checkpoint import COMPLETE_MARKER, list_checkpoints, prune_checkpoints
from rlbus.learner.rolling_checkpoint import CheckpointCost, rolling_due


def test_a_step_stages_when_the_cost_spread_over_the_steps_since_fits_the_budget() -> None:
    assert rolling_due(1, None, step_s=1.0, budget=0.05)  # never measured: stage and learn the cost
    assert rolling_due(1, 0.01, step_s=1.0, budget=0.05)  # 1% of a step: every step
    assert not rolling_due(1, 0.2, step_s=1.0, budget=0.05)  # 20% of a step: every 4th
    assert [rolling_due(k, 0.2, 1.0, 0.05) for k in (2, 3, 4)] == [False, False, True]
    assert not rolling_due(100, 0.0, 1.0, 0.0)  # budget 0: off


def _complete(root: Path, step: int) -> None:
    d = root / f"step_{step}"
    d.mkdir(parents=True)
    (d / COMPLETE_MARKER).write_text("{}")


def test_the_cost_counts_what_the_steps_during_the_write_took_beyond_a_plain_step() -> None:
    """Staging 0.18 s of 0.34 s steps at budget 5% would be due every 11th step; the 3 steps the write slowed
    by 0.03 s each make the cost 0.27 s: due every 16th."""
    cost = CheckpointCost()
    cost.step(0.34, writing=False)
    assert cost.due(0.05), "never measured: stage and learn the cost"
    cost.staged(0.18)
    for _ in range(3):
        cost.step(0.37, writing=True)
    assert cost.write_slowdown_s == pytest.approx(0.09)
    for _ in range(12):
        cost.step(0.34, writing=False)
    assert cost.steps_since == 15 and not cost.due(0.05)
    cost.step(0.34, writing=False)
    assert cost.due(0.05)
    cost.staged(0.18)
    assert cost.write_slowdown_s == 0.0 and cost.steps_since == 0


def test_pruning_keeps_the_kept_ones_and_only_the_newest_rolling_one(tmp_path: Path) -> None:
    for step in (3, 4, 5, 6, 7):
        _complete(tmp_path, step)
    (tmp_path / "step_8.tmp").mkdir()  # a write that crashed
    every_third = lambda step: step % 3 == 0  # noqa: E731
    prune_checkpoints(tmp_path, keep=3, is_kept=every_third)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [3, 6, 7]
    assert not (tmp_path / "step_8.tmp").exists()
    _complete(tmp_path, 9)
    prune_checkpoints(tmp_path, keep=1, is_kept=every_third)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [9]
