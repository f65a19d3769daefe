"""`rlbus up`'s restart rule: on failure, with a doubling backoff, up to a cap; never a refused service."""

from __future__ import annotations

from rlbus.service import EXIT_PUSH_FAILED, EXIT_REFUSED
from rlbus.supervisor import Action, Supervisor


def test_restarts_after_a_doubling_backoff_then_gives_up() -> None:
    sup = Supervisor(max_restarts=2, backoff_s=1.0)
    assert sup.on_exit("rollout-0", None, 0.0) is Action.NOTHING  # running
    assert sup.on_exit("rollout-0", -9, 10.0) is Action.NOTHING  # killed: restart due at 11.0
    assert sup.on_exit("rollout-0", -9, 10.9) is Action.NOTHING
    assert sup.on_exit("rollout-0", -9, 11.0) is Action.RESTART
    assert sup.on_exit("rollout-0", 1, 20.0) is Action.NOTHING  # died again: due at 22.0 (2 s)
    assert sup.on_exit("rollout-0", 1, 21.9) is Action.NOTHING
    assert sup.on_exit("rollout-0", 1, 22.0) is Action.RESTART
    assert sup.on_exit("rollout-0", 1, 30.0) is Action.GIVE_UP  # the cap: two restarts
    assert sup.restarts == {"rollout-0": 2}


def test_backoff_is_capped_and_counted_per_service() -> None:
    sup = Supervisor(max_restarts=10, backoff_s=1.0, max_backoff_s=3.0)
    for _ in range(4):
        sup.restarts["learner"] = sup.restarts.get("learner", 0)
        t = 100.0 * (sup.restarts["learner"] + 1)
        assert sup.on_exit("learner", 3, t) is Action.NOTHING
        assert sup.on_exit("learner", 3, t + 3.0) is Action.RESTART  # never more than max_backoff_s
    assert sup.on_exit("reward", 1, 0.0) is Action.NOTHING and sup.on_exit("reward", 1, 1.0) is Action.RESTART


def test_refused_and_clean_exits_are_never_restarted() -> None:
    sup = Supervisor(max_restarts=5)
    assert sup.on_exit("reward", EXIT_REFUSED, 0.0) is Action.REFUSED
    assert sup.on_exit("learner", EXIT_PUSH_FAILED, 0.0) is Action.STOP  # a restart would fail the same way
    assert sup.on_exit("rollout-0", 0, 0.0) is Action.NOTHING
    assert sup.restarts == {}
