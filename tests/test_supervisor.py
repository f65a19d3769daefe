"""`rlbus up`'s restart rule: on failure, with a doubling backoff, up to a cap; never a refused service."""

from __future__ import annotations

from rlbus.service import EXIT_PUSH_FAILED, EXIT_REFUSED
from rlbus.supervisor import STABLE_RUN_S, Action, Supervisor


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


def test_backoff_starts_over_after_a_stable_run() -> None:
    """Docker's rule: the delay doubles while a service keeps dying young, and is the first delay again
    once it had run STABLE_RUN_S (a replica killed every minute is not a crash loop)."""
    sup = Supervisor(max_restarts=10, backoff_s=1.0)
    assert sup.on_exit("rollout-0", -9, 10.0, started_at=9.0) is Action.NOTHING  # young: 1 s
    assert sup.on_exit("rollout-0", -9, 11.0, started_at=9.0) is Action.RESTART
    assert sup.on_exit("rollout-0", -9, 12.0, started_at=11.0) is Action.NOTHING  # young again: 2 s
    assert sup.on_exit("rollout-0", -9, 13.9, started_at=11.0) is Action.NOTHING
    assert sup.on_exit("rollout-0", -9, 14.0, started_at=11.0) is Action.RESTART
    ran_long = 14.0 + STABLE_RUN_S
    assert sup.on_exit("rollout-0", -9, ran_long, started_at=14.0) is Action.NOTHING  # stable: 1 s again
    assert sup.on_exit("rollout-0", -9, ran_long + 1.0, started_at=14.0) is Action.RESTART
    assert sup.restarts == {"rollout-0": 3}  # the cap still counts every restart
