"""The learning bench reads rlbus's curve on TRL's clock: evaluation time is off both (bench/learning.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


@pytest.fixture
def learning(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))  # the bench imports its siblings by name, as when it is run
    import learning as module

    yield module
    sys.modules.pop("learning", None)


def test_an_evaluation_is_placed_at_its_step_start_and_its_hold_is_off_the_clock(learning) -> None:
    launched = 1000.0

    def row(step: int, end: float, step_s: float, **val: float) -> dict:
        return {"step": step, "time": launched + end, "timing/step_s": step_s, **val}

    rows = [
        {"step": 0, "time": launched + 9.0, "val-core/x/reward/mean@1": 0.2},  # verl's row: not a point
        row(1, 10.0, 4.0, **{"val/reward_mean": 0.2, "timing/validation_wait_s": 1.0}),
        row(2, 11.0, 1.0),
        row(3, 13.0, 1.0, **{"val/reward_mean": 0.5, "timing/validation_wait_s": 0.5}),
        row(4, 14.0, 1.0),
        row(5, 15.5, 1.0),  # 14.0 on the clock without 1.5 s of holds
        row(6, 16.6, 1.0),  # past a 15 s budget on that clock
    ]
    points, steps, updates = learning.rlbus_points(rows, launched, budget_s=15.0)
    # step 1 started at 6 s (its end less its 4 s); step 3 at 13 - 1 (held before) - 1 = 11 s
    assert points == [(6.0, 0.2), (11.0, 0.5)]
    assert steps == 5
    assert updates == [0, 2]  # the policies step 1 and step 3 started from
    curve = learning.Curve("rlbus", points, steps, updates)
    assert curve.by_updates() == "0:0.200, 2:0.500"


def test_accuracy_at_equal_time_is_read_at_every_one_of_trls_evaluations(learning) -> None:
    trl = learning.Curve("TRL", [(10.0, 0.4), (30.0, 0.6), (50.0, 0.7), (70.0, 0.75)])
    # no reading before 13 s, behind at 30 s, level at 50 s (0.7 >= 0.7), ahead by 70 s
    rlbus = learning.Curve("rlbus", [(13.0, 0.4), (40.0, 0.55), (45.0, 0.7), (65.0, 0.8)])
    assert rlbus.behind(trl) == [10.0, 30.0]
    assert trl.behind(trl) == []
    assert learning.Curve("none").behind(trl) == [10.0, 30.0, 50.0, 70.0]
