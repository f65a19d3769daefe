"""The learner's admission of ready groups (rlbus.learner.admission): what it refuses, and a property-based
fuzz over every ReadyGroup / Trajectory field: a group it admits always collates into finite, in-range
tensors of the right shapes, and an honest group is never refused."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlbus.learner.admission import ReadyLimits, rejection
from rlbus.learner.batch import collate
from rlbus.messages import (
    PromptWork,
    ReadyGroup,
    Sample,
    SamplingParams,
    ScoredGroup,
    TrajectoryGroup,
    decode,
    encode,
)

VOCAB = 50
LIMITS = ReadyLimits(
    run_id="run",
    vocab_size=VOCAB,
    max_prompt_tokens=12,
    max_response_tokens=8,
    train_samples=3,
    needs_ref=False,
)
PAD = 0


def honest(
    n: int = 3, *, index: int = 7, lengths: tuple[int, ...] = (2, 5, 1), ref: bool = False
) -> ReadyGroup:
    work = PromptWork(
        run_id="run",
        prompt_id="run-p7",
        index=index,
        step=1,
        min_policy_version=0,
        prompt_ids=[3, 4, 5],
        n=n,
        sampling=SamplingParams(max_tokens=8),
    )
    samples = [
        Sample(response_ids=[(i + k) % VOCAB for k in range(lengths[i])], logprobs=[-0.5] * lengths[i])
        for i in range(n)
    ]
    traj = TrajectoryGroup(work=work, samples=samples, policy_version=0, replica_id="r0", engine="hf")
    scored = ScoredGroup(trajectories=traj, rewards=[1.0, 0.0, 0.5][:n], correct=[True, False, False][:n])
    refs = [np.full(len(s.response_ids), -0.7, np.float32) for s in samples] if ref else None
    return ReadyGroup(scored=scored, ref_logprobs=refs)


def mutate(group: ReadyGroup, **changes: object) -> ReadyGroup:
    """`group` with fields replaced by dotted path (re-validated through the wire, as the learner sees it)."""
    raw = group.model_dump(mode="python")
    for path, value in changes.items():
        node = raw
        *parents, last = path.split(".")
        for key in parents:
            node = node[int(key)] if key.isdigit() else node[key]
        node[int(last) if last.isdigit() else last] = value
    return decode(encode(ReadyGroup.model_validate(raw)), ReadyGroup)


HOSTILE = [
    ("fewer rewards than samples", {"scored.rewards": [1.0]}, "rewards"),
    ("fewer correct flags", {"scored.correct": [True]}, "correct"),
    (
        "log-probs shorter than the response",
        {"scored.trajectories.samples.1.logprobs": [-0.1, -0.2]},
        "log-probs",
    ),
    ("one log-prob for a long response", {"scored.trajectories.samples.1.logprobs": [-0.1]}, "log-probs"),
    (
        "out-of-vocabulary response token",
        {"scored.trajectories.samples.0.response_ids": [1, VOCAB]},
        "vocabulary",
    ),
    ("negative token id", {"scored.trajectories.samples.0.response_ids": [-1, 2]}, "vocabulary"),
    ("out-of-vocabulary prompt token", {"scored.trajectories.work.prompt_ids": [3, VOCAB + 9]}, "vocabulary"),
    ("NaN log-prob", {"scored.trajectories.samples.2.logprobs": [math.nan]}, "non-finite"),
    ("+inf reward", {"scored.rewards": [1.0, math.inf, 0.0]}, "not finite"),
    ("NaN reward", {"scored.rewards": [math.nan, 0.0, 0.0]}, "not finite"),
    ("too many samples", {"scored.trajectories.work.n": 4}, "samples"),
    ("another data index", {"scored.trajectories.work.index": 8}, "data index"),
    ("another run", {"scored.trajectories.work.run_id": "other"}, "run id"),
    ("empty prompt", {"scored.trajectories.work.prompt_ids": []}, "empty prompt"),
    ("overlong prompt", {"scored.trajectories.work.prompt_ids": [1] * 13}, "over the run's limit"),
    (
        "overlong response",
        {
            "scored.trajectories.samples.0.response_ids": [1] * 9,
            "scored.trajectories.samples.0.logprobs": [-1.0] * 9,
        },
        "max_response_length",
    ),
    ("reward errors miscounted", {"scored.reward_errors": ["boom"]}, "reward errors"),
    ("reference rows miscounted", {"ref_logprobs": [[-0.1, -0.1]]}, "reference log-prob rows"),
]


def test_an_honest_group_is_admitted_and_collates() -> None:
    group = honest()
    assert rejection(group, LIMITS, 7) is None
    batch = collate([group], PAD)
    assert batch.size == 3 and int(batch.response_mask.sum()) == 8


@pytest.mark.parametrize(("what", "changes", "fragment"), HOSTILE, ids=[h[0] for h in HOSTILE])
def test_each_hostile_shape_is_refused_with_its_reason(what: str, changes: dict, fragment: str) -> None:
    group = mutate(honest(ref="ref_logprobs" in changes), **changes)
    reason = rejection(group, LIMITS, 7)
    assert reason is not None and fragment in reason, (what, reason)


def test_missing_reference_log_probs_are_refused_when_a_kl_term_needs_them() -> None:
    needs_ref = ReadyLimits(**{**LIMITS.__dict__, "needs_ref": True})
    assert "reference" in (rejection(honest(), needs_ref, 7) or "")
    assert rejection(honest(ref=True), needs_ref, 7) is None
    bad_ref = mutate(honest(ref=True), **{"ref_logprobs.0": [math.inf, -1.0]})
    assert "non-finite" in (rejection(bad_ref, needs_ref, 7) or "")


# ---------------------------------------------------------------------------------------------- the fuzz

_ints = st.integers(min_value=-3, max_value=VOCAB + 3)
_floats = st.one_of(
    st.floats(min_value=-30.0, max_value=0.0),
    st.sampled_from([math.nan, math.inf, -math.inf, 0.0, 1e30]),
)


@st.composite
def fuzzed_groups(draw: st.DrawFn) -> tuple[ReadyGroup, bool]:
    """A ready group built field by field, each field either honest or drawn freely; returns (group, every
    field was left honest)."""
    tamper = draw(st.booleans())

    def maybe(honest_value: object, wild: st.SearchStrategy) -> object:
        return draw(wild) if tamper and draw(st.booleans()) else honest_value

    n_real = 3
    lengths = [draw(st.integers(min_value=0, max_value=8)) for _ in range(n_real)]
    n = maybe(n_real, st.integers(min_value=1, max_value=5))
    samples = []
    for i in range(n):
        length = lengths[i] if i < n_real else draw(st.integers(min_value=0, max_value=9))
        response = [draw(st.integers(min_value=0, max_value=VOCAB - 1)) for _ in range(length)]
        response = maybe(response, st.lists(_ints, max_size=10))
        logprobs = [draw(st.floats(min_value=-20.0, max_value=0.0)) for _ in range(length)]
        logprobs = maybe(logprobs, st.lists(_floats, max_size=10))
        samples.append(Sample(response_ids=response, logprobs=logprobs, finish_reason="stop"))
    work = PromptWork(
        run_id=maybe("run", st.sampled_from(["run", "other"])),
        prompt_id="run-p7",
        index=maybe(7, st.integers(min_value=0, max_value=9)),
        step=draw(st.integers(min_value=0, max_value=3)),
        min_policy_version=0,
        prompt_ids=maybe([3, 4, 5], st.lists(_ints, max_size=14)),
        n=maybe(n, st.integers(min_value=1, max_value=5)),
        sampling=SamplingParams(temperature=draw(st.sampled_from([0.0, 0.7, 1.0])), max_tokens=8),
    )
    traj = TrajectoryGroup(
        work=work,
        samples=samples,
        policy_version=draw(st.integers(min_value=0, max_value=3)),
        replica_id="r0",
        engine="hf",
    )
    rewards = maybe(
        [draw(st.floats(min_value=-1, max_value=1)) for _ in range(n)], st.lists(_floats, max_size=6)
    )
    correct = maybe([draw(st.booleans()) for _ in range(n)], st.lists(st.booleans(), max_size=6))
    errors = maybe([], st.lists(st.one_of(st.none(), st.text(max_size=3)), max_size=6))
    scored = ScoredGroup(trajectories=traj, rewards=rewards, correct=correct, reward_errors=errors)
    refs = draw(st.booleans())
    ref_rows = [[-0.5] * len(s.response_ids) for s in samples] if refs else None
    ref_rows = maybe(ref_rows, st.one_of(st.none(), st.lists(st.lists(_floats, max_size=10), max_size=6)))
    group = ReadyGroup(scored=scored, ref_logprobs=ref_rows)
    untouched = (
        n == n_real
        and work.n == n
        and work.run_id == "run"
        and work.index == 7
        and work.prompt_ids == [3, 4, 5]
        and all(
            len(s.response_ids) == lengths[i]
            and all(0 <= t < VOCAB for t in s.response_ids)
            and len(s.logprobs) == len(s.response_ids)
            and np.isfinite(s.logprobs).all()
            for i, s in enumerate(samples)
        )
        and len(rewards) == n
        and all(math.isfinite(r) for r in rewards)
        and len(correct) == n
        and errors == []
        and (ref_rows is None or ref_rows == [[-0.5] * len(s.response_ids) for s in samples])
    )
    return decode(encode(group), ReadyGroup), untouched


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fuzzed_groups())
def test_fuzz_an_admitted_group_always_collates_clean(drawn: tuple[ReadyGroup, bool]) -> None:
    group, untouched = drawn
    reason = rejection(group, LIMITS, 7)
    if untouched:
        assert reason is None, f"an honest group was refused: {reason}"
    if reason is not None:
        return
    batch = collate([group, honest()], PAD)  # beside an honest batch-mate, as in a real step
    rows = len(group.scored.trajectories.samples) + 3
    assert batch.size == rows
    assert int(batch.input_ids.min()) >= 0 and int(batch.input_ids.max()) < VOCAB
    assert batch.behaviour_logprobs.isfinite().all() and batch.rewards.isfinite().all()
    want_tokens = sum(len(s.response_ids) for g in (group, honest()) for s in g.scored.trajectories.samples)
    assert int(batch.response_mask.sum()) == want_tokens
    for b, sample in enumerate(group.scored.trajectories.samples):
        got = batch.behaviour_logprobs[b][batch.response_mask[b] > 0].numpy()
        np.testing.assert_array_equal(got, sample.logprobs)  # no broadcast, no truncation
