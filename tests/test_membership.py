"""Membership by evidence (rlbus.learner.membership): the pure decisions, each against a hand-worked case."""

from __future__ import annotations

from rlbus.learner.membership import (
    PushPlan,
    Suspect,
    after_failure,
    after_roll_call,
    after_success,
    backoff_s,
    forget_absent,
    plan_push,
)

BASE = 30.0


def test_unchanged_members_keep_the_group_without_a_roll_call() -> None:
    live = {"r0": "a", "r1": "b"}
    assert plan_push(live, {}, {"r0": "a", "r1": "b"}, now=100.0) == PushPlan(True, (), ())


def test_a_new_heartbeat_or_a_new_process_is_called_to_the_roll() -> None:
    plan = plan_push({"r0": "a", "r1": "b"}, {}, {"r0": "a"}, now=0.0)
    assert plan == PushPlan(False, ("r0", "r1"), ())
    restarted = plan_push({"r0": "a2"}, {}, {"r0": "a"}, now=0.0)
    assert restarted.call == ("r0",) and not restarted.keep
    assert plan_push({"r0": "a"}, {}, None, now=0.0).call == ("r0",)  # a new group is asked for


def test_silence_at_the_roll_makes_a_suspect_and_the_next_push_ignores_it() -> None:
    live = {"r0": "a", "ghost": "g"}
    plan = plan_push(live, {}, {"r0": "a"}, now=10.0)
    members, suspects = after_roll_call(plan, live, {"r0": "a"}, {}, now=10.0, base_s=BASE)
    assert members == {"r0": "a"}
    assert suspects == {"ghost": Suspect("g", 1, 10.0 + BASE, "silent at the roll call")}
    # the forged beat goes on: nothing changes for the next pushes, until its backoff ends
    assert plan_push(live, suspects, members, now=20.0).keep
    assert plan_push(live, suspects, members, now=10.0 + BASE) == PushPlan(False, ("ghost", "r0"), ("ghost",))
    # silent again: twice the wait
    _, again = after_roll_call(
        plan_push(live, suspects, members, now=40.0), live, {"r0": "a"}, suspects, now=40.0, base_s=BASE
    )
    assert again["ghost"].strikes == 2 and again["ghost"].retry_at == 40.0 + 2 * BASE


def test_an_answer_with_another_incarnation_is_not_evidence() -> None:
    live = {"r0": "new"}
    members, suspects = after_roll_call(PushPlan(False, ("r0",), ()), live, {"r0": "old"}, {}, 0.0, BASE)
    assert members == {} and suspects["r0"].strikes == 1


def test_a_restarted_replica_is_called_at_once_but_a_forger_changing_incarnations_is_not() -> None:
    suspects = {"r0": Suspect("dead", 1, 1000.0)}
    assert plan_push({"r0": "fresh"}, suspects, {}, now=5.0).probes == ("r0",)
    assert plan_push({"r0": "dead"}, suspects, {}, now=5.0).keep  # the same dead process: wait
    many = {"r0": Suspect("x", 3, 1000.0)}
    assert plan_push({"r0": "y"}, many, {}, now=5.0).keep


def test_an_answering_suspect_joins_and_only_a_good_push_clears_it() -> None:
    suspects = {"r0": Suspect("a", 2, 0.0)}
    plan = plan_push({"r0": "a"}, suspects, {}, now=1.0)
    members, after = after_roll_call(plan, {"r0": "a"}, {"r0": "a"}, suspects, now=1.0, base_s=BASE)
    assert members == {"r0": "a"} and after == suspects  # strikes kept until the push succeeds
    assert after_success(["r0"], after) == {}


def test_a_failed_push_blames_who_missed_the_rendezvous_or_recalls_everyone() -> None:
    members = {"r0": "a", "r1": "b"}
    blamed = after_failure(members, ["r1"], {}, now=5.0, base_s=BASE, reason="rendezvous")
    assert set(blamed) == {"r1"} and blamed["r1"].strikes == 1 and blamed["r1"].retry_at == 5.0 + BASE
    unknown = after_failure(members, None, {}, now=5.0, base_s=BASE, reason="broadcast broke")
    assert {rid: (s.strikes, s.retry_at) for rid, s in unknown.items()} == {"r0": (0, 5.0), "r1": (0, 5.0)}
    assert plan_push(members, unknown, members, now=5.0).call == ("r0", "r1")


def test_backoff_doubles_and_is_capped_and_absent_suspects_are_forgotten() -> None:
    assert [backoff_s(k, 10.0) for k in (1, 2, 3)] == [10.0, 20.0, 40.0]
    assert backoff_s(30, 10.0) == 600.0
    suspects = {"gone": Suspect("a", 1, 5.0), "waiting": Suspect("b", 1, 50.0), "here": Suspect("c", 1, 5.0)}
    assert set(forget_absent(["here"], suspects, now=10.0)) == {"waiting", "here"}


def test_suspects_round_trip_through_the_kv_form() -> None:
    s = Suspect("inc", 3, 123.5, "silent")
    assert Suspect.from_dict(s.to_dict()) == s
