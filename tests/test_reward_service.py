"""Reward service: user functions are sandboxed, failures are recorded, implementations swap live."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import numpy as np
import pytest
from e2e_utils import Run, make_config, wait_until

from rlbus.config.schema import RewardConfig
from rlbus.launcher import ServiceProcess
from rlbus.messages import PromptWork, Sample, SamplingParams, TrajectoryGroup
from rlbus.reward.scorers import FunctionScorer, TaskScorer, build_scorer
from rlbus.reward.service import chunk_groups, score_group

TESTS = str(Path(__file__).parent)
STEPS = 40
WAITING = "waiting for ready trajectories"  # the learner's log line while a batch is incomplete


@pytest.fixture(autouse=True)
def _tests_importable(monkeypatch) -> None:
    monkeypatch.syspath_prepend(TESTS)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([TESTS, os.environ.get("PYTHONPATH", "")]))


def _group(texts: list[str], answer: str = "46") -> TrajectoryGroup:
    work = PromptWork(
        run_id="r",
        prompt_id="p",
        index=0,
        step=0,
        min_policy_version=0,
        prompt_ids=[1],
        prompt_text="12+34=",
        meta={"task": "addition", "digits": 2, "answer": answer},
        n=len(texts),
        sampling=SamplingParams(),
    )
    samples = [Sample(response_ids=[1], logprobs=np.zeros(1, np.float32), text=t) for t in texts]
    return TrajectoryGroup(work=work, samples=samples, policy_version=0, replica_id="x", engine="hf")


def test_task_scorer_scores_addition() -> None:
    scored = score_group(TaskScorer(), _group(["46", "47"]), on_error=0.0)
    assert scored.rewards == [1.0, 0.0] and scored.correct == [True, False]


def test_user_function_raising_is_recorded_not_fatal() -> None:
    scorer = FunctionScorer("reward_fns:always_raises", timeout_s=10, memory_mb=512)
    try:
        scored = score_group(scorer, _group(["46", "1"]), on_error=-0.5)
    finally:
        scorer.close()
    assert scored.rewards == [-0.5, -0.5]
    assert all("user code is broken" in e for e in scored.reward_errors)


@pytest.mark.timeout(60)
def test_user_function_timeout_and_memory_limit() -> None:
    slow = FunctionScorer("reward_fns:sleeps", timeout_s=1.0, memory_mb=512)
    hog = FunctionScorer("reward_fns:hogs_memory", timeout_s=20.0, memory_mb=512)
    try:
        s1 = score_group(slow, _group(["46"]), on_error=0.0)
        s2 = score_group(hog, _group(["46"]), on_error=0.0)
        assert "exceeded 1.0s" in s1.reward_errors[0]
        assert s2.reward_errors[0] is not None and s2.rewards == [0.0]
        # the sandbox comes back after a kill: a normal function still works in a new worker
        good = FunctionScorer("reward_fns:double_score", timeout_s=10, memory_mb=512)
        assert score_group(good, _group(["46"]), on_error=0.0).rewards == [2.0]
        good.close()
    finally:
        slow.close()
        hog.close()


@pytest.mark.timeout(60)
def test_a_group_scores_in_one_round_trip_and_each_failure_stays_with_its_own_sample() -> None:
    """A group's samples go to the sandbox together (one round trip, not one per response); a raising, a hanging
    or a non-reward sample marks only itself, and the worker comes back after the hang."""
    from rlbus.reward import sandbox

    flaky = FunctionScorer("reward_fns:flaky_addition", timeout_s=10, memory_mb=512)
    slow = FunctionScorer("reward_fns:sleeps_on_request", timeout_s=1.0, memory_mb=512)
    trips = 0
    real_call_each = sandbox.Sandbox.call_each

    def counted(self, calls):  # the real round trip, counted
        nonlocal trips
        trips += 1
        return real_call_each(self, calls)

    try:
        sandbox.Sandbox.call_each = counted  # type: ignore[method-assign]
        texts = [str(40 + i) for i in range(64)]  # "46" is right; flaky_addition raises on 86, 87 and 98
        scored = score_group(flaky, _group(texts), on_error=-1.0)
        assert trips == 1
        raised = [e is not None for e in scored.reward_errors]
        assert 0 < sum(raised) < len(texts), "the fixture should make some samples raise and not others"
        for text, reward, error in zip(texts, scored.rewards, scored.reward_errors, strict=True):
            if error is None:
                assert reward == (1.0 if text == "46" else 0.0)
            else:
                assert "flaky reward function" in error and reward == -1.0
        hung = score_group(slow, _group(["46", "slow", "47"]), on_error=-1.0)
        assert hung.rewards == [2.0, -1.0, 0.0]
        assert hung.reward_errors[0] is None and "exceeded 1.0s" in str(hung.reward_errors[1])
        assert score_group(slow, _group(["46"]), on_error=-1.0).rewards == [2.0]  # a fresh worker
    finally:
        sandbox.Sandbox.call_each = real_call_each  # type: ignore[method-assign]
        flaky.close()
        slow.close()


def test_a_function_scores_groups_in_chunks_of_samples_and_a_large_group_alone() -> None:
    """An evaluation's one-sample groups share a round trip; training groups go two of n=8 at a time, a group
    larger than a chunk alone, and every group exactly once, in order."""
    assert [list(r) for r in chunk_groups([1] * 40, 16)] == [
        list(range(16)),
        list(range(16, 32)),
        list(range(32, 40)),
    ]
    assert [list(r) for r in chunk_groups([8] * 5, 16)] == [[0, 1], [2, 3], [4]]
    assert [list(r) for r in chunk_groups([32, 1, 1, 16], 16)] == [[0], [1, 2], [3]]
    assert chunk_groups([], 16) == []


def test_bad_function_spec_fails_at_start_naming_it() -> None:
    with pytest.raises(ValueError, match="no_such_mod"):
        build_scorer(RewardConfig(type="function", function="no_such_mod:fn"))


@pytest.mark.slow  # 25 s on 2 cores: make test-slow
@pytest.mark.timeout(400)
def test_reward_implementations_swap_while_the_run_is_live(
    nats_url: str, run_id: str, tmp_path: Path
) -> None:
    cfg = make_config(
        nats_url,
        run_id,
        tmp_path,
        [
            "trainer.async_level=1",
            f"trainer.total_training_steps={STEPS}",
            "data.train_batch_size=8",
            "rollout.n=4",
            "trainer.val_before_train=false",
            "trainer.test_freq=-1",
        ],
    )
    with Run(cfg) as run:
        run.wait_for_step(3, 200)
        waited = run.logs("learner", tail=10**6).count(WAITING)
        first = run.proc("reward")
        assert first.proc is not None
        first.proc.send_signal(signal.SIGTERM)  # graceful: finishes its item, the rest stays on the bus
        first.proc.wait(30)
        stalled_at = len(run.metrics())
        # With no scorer the learner waits for scored work, and says so, instead of training on unscored work.
        wait_until(
            lambda: run.logs("learner", tail=10**6).count(WAITING) > waited,
            120,
            "the learner to say it waits for ready trajectories",
        )
        assert len(run.metrics()) <= stalled_at + 2, "steps went on without a reward service"
        assert stalled_at < STEPS, "the run finished before the swap; make it longer"
        swapped = ServiceProcess(
            "reward-fn",
            "reward",
            [
                "--config",
                str(run.config_path),
                "--instance-id",
                "reward-fn",
                "reward.type=function",
                "reward.function=reward_fns:double_score",
            ],
            run.run_dir / "logs" / "reward-fn.log",
            env={"PYTHONPATH": TESTS, "OMP_NUM_THREADS": "1"},
        ).start()
        run.procs.append(swapped)
        rc = run.wait_learner(300)
        assert rc == 0, run.logs("learner") + "\n" + run.logs("reward-fn")
        rows = run.metrics()
        ledger = run.ledger()
    assert len(rows) == STEPS
    assert set(ledger["dispatched"]) == set(ledger["trained"]) | set(ledger["dropped"])
    assert len(ledger["trained"]) == STEPS * 8
    # The last steps were scored by the function (it pays 2.0 per right answer, the verifier 1.0).
    late = rows[-1]
    assert late["reward/accuracy"] > 0 and late["reward/mean"] == pytest.approx(2 * late["reward/accuracy"])


# ---------------------------------------------------------------- the start-up check and the failure streak


def test_a_function_with_the_wrong_signature_is_refused_at_start_with_the_reason() -> None:
    from rlbus.reward.scorers import RewardFunctionRefused

    with pytest.raises(
        RewardFunctionRefused,
        match=r"two_arguments\(prompt.*cannot be called as fn\(prompt, response, meta\)",
    ):
        FunctionScorer("reward_fns:two_arguments", timeout_s=10, memory_mb=512)
    with pytest.raises(RewardFunctionRefused, match="compute_score"):
        FunctionScorer("reward_fns:verl_style_missing_ground_truth", 10, 512, signature="verl")
    with pytest.raises(RewardFunctionRefused, match="with lists"):
        FunctionScorer("reward_fns:two_arguments", 10, 512, manager="batch")


def test_the_sample_call_refuses_a_non_reward_and_reports_an_error() -> None:
    from rlbus.reward.scorers import RewardFunctionRefused

    nothing = FunctionScorer("reward_fns:returns_nothing", timeout_s=10, memory_mb=512)
    raising = FunctionScorer("reward_fns:always_raises", timeout_s=10, memory_mb=512)
    good = FunctionScorer("reward_fns:double_score", timeout_s=10, memory_mb=512)
    batch = FunctionScorer("reward_fns:batch_compute_score", timeout_s=10, memory_mb=512, manager="batch")
    try:
        with pytest.raises(RewardFunctionRefused, match="returned None"):
            nothing.check()
        assert "user code is broken" in (raising.check() or "")
        assert good.check() is None
        assert batch.check() is None
    finally:
        for scorer in (nothing, raising, good, batch):
            scorer.close()


def test_the_failure_streak_counts_groups_whose_every_call_failed() -> None:
    from rlbus.messages import ScoredGroup
    from rlbus.reward.service import FailureStreak

    def scored(errors: list[str | None]) -> ScoredGroup:
        return ScoredGroup(
            trajectories=_group(["46"] * len(errors)),
            rewards=[0.0] * len(errors),
            correct=[False] * len(errors),
            reward_errors=errors,
        )

    streak = FailureStreak(3)
    assert not streak.see(scored(["a", "b"]))
    assert not streak.see(scored(["c", None]))  # one call worked: the streak starts again
    assert [streak.see(scored(["boom", "boom"])) for _ in range(3)] == [False, False, True]
    assert streak.first_error == "boom"
    never = FailureStreak(0)
    assert not any(never.see(scored(["x"])) for _ in range(50))


@pytest.mark.timeout(240)
def test_a_reward_function_that_always_raises_stops_the_run_with_the_reason(
    nats_url: str, run_id: str, tmp_path: Path
) -> None:
    """It used to end with exit 0 and Reward 0.000: now `rlbus up` stops, the error on the console."""
    from e2e_utils import rlbus_up

    from rlbus.service import EXIT_REFUSED

    done = rlbus_up(
        tmp_path,
        nats_url,
        run_id,
        "reward.type=function",
        "reward.function=reward_fns:always_raises",
        "reward.max_failed_groups=4",
        "trainer.total_training_steps=50",
        "data.train_batch_size=4",
        "trainer.val_before_train=false",
        timeout=200,
    )
    out = done.stdout + done.stderr
    assert done.returncode == EXIT_REFUSED, out[-3000:]
    assert "4 groups in a row had every reward call fail" in out, out[-3000:]
    assert "user code is broken" in out, out[-3000:]
