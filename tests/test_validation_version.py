"""Validation is answered by the weights it is labelled with: the before-training reading of a run equals an
offline greedy evaluation of the initial weights on the same held-out prompts."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlbus.config import RlbusConfig
from rlbus.learner.data import load_split
from rlbus.messages import SamplingParams
from rlbus.rollout.engines.base import GenerationRequest
from rlbus.rollout.engines.hf import HFEngine
from rlbus.tasks import get_task
from rlbus.tiny_model import default_model_path


def offline_greedy_accuracy(cfg: RlbusConfig) -> float:
    engine = HFEngine(default_model_path(), device="cpu")
    records = load_split(cfg.data, "val")
    task = get_task(cfg.data.task, digits=cfg.data.task_digits)
    greedy = SamplingParams(temperature=0.0, max_tokens=cfg.data.max_response_length)
    requests = [
        GenerationRequest(engine.tokenizer(p, add_special_tokens=False)["input_ids"], 1, greedy)
        for p, _ in records
    ]
    completions = engine.generate(requests)
    correct = [task.score(c[0].text, meta)[1] for c, (_, meta) in zip(completions, records, strict=True)]
    return sum(correct) / len(correct)


@pytest.mark.timeout(300)
def test_before_training_reading_equals_offline_greedy(nats_url: str, run_id: str, tmp_path: Path) -> None:
    from e2e_utils import Run, make_config

    cfg = make_config(
        nats_url,
        run_id,
        tmp_path,
        [
            "trainer.total_training_steps=2",
            "trainer.val_before_train=true",
            "trainer.test_freq=-1",
            "trainer.async_level=1",
            "data.num_val_examples=128",
        ],
    )
    with Run(cfg) as run:
        assert run.wait_learner(240) == 0, run.logs("learner")
    rows = run.metrics()
    assert rows[0]["step"] == 0 and any(k.startswith("val-core/") for k in rows[0])  # verl's step-0 reading
    first = next(r for r in rows if "val/version" in r)  # ours, in the first step's row
    assert first["val/version"] == first["val/version_max"] == 0  # the initial weights, and only they
    assert first["val/prompts"] == 128
    assert first["val/accuracy"] == pytest.approx(offline_greedy_accuracy(cfg), abs=1e-9)


@pytest.mark.timeout(300)
def test_val_only_scores_the_starting_policy_and_trains_nothing(
    nats_url: str, run_id: str, tmp_path: Path
) -> None:
    """verl's trainer.val_only: one validation of the initial weights, then the run ends; no step is trained."""
    from e2e_utils import Run, make_config

    cfg = make_config(nats_url, run_id, tmp_path, ["trainer.val_only=true", "data.num_val_examples=64"])
    with Run(cfg) as run:
        assert run.wait_learner(240) == 0, run.logs("learner")
        rows = run.metrics()
        ledger = run.ledger()
    assert len(rows) == 1 and "reward/mean" not in rows[0], rows
    assert rows[0]["val/prompts"] == 64 and rows[0]["val/version"] == 0
    assert rows[0]["val/accuracy"] == pytest.approx(offline_greedy_accuracy(cfg), abs=1e-9)
    assert not ledger["trained"] and not ledger["dispatched"]


@pytest.mark.timeout(300)
def test_an_evaluation_during_training_is_answered_by_its_own_step_weights(
    nats_url: str, run_id: str, tmp_path: Path
) -> None:
    """The learner trains beside an evaluation and pushes newer weights only once it is answered: every
    answer of the evaluation at step s comes from version s, whatever was queued at the replica. At
    async_level=1 the step's batch is already there, so the update ends while most of the evaluation is still
    queued: a learner that pushed on without waiting failed here (at async_level=0 the batch, queued behind
    the evaluation, came only after it, so that learner passed)."""
    from e2e_utils import Run, make_config

    cfg = make_config(
        nats_url,
        run_id,
        tmp_path,
        [
            "trainer.total_training_steps=6",
            "trainer.val_before_train=true",
            "trainer.test_freq=2",
            "trainer.async_level=1",
            # an evaluation of many passes (16 rows each), so it is still being answered when the update ends
            "data.num_val_examples=128",
            "rollout.prompts_per_batch=2",
            "rollout.n=8",
        ],
    )
    with Run(cfg) as run:
        assert run.wait_learner(240) == 0, run.logs("learner")
    rows = run.metrics()
    held_out = [(r["step"], r["val/version"], r["val/version_max"]) for r in rows if "val/version" in r]
    # ours in the row of the step after it (1-based), the final one in a row of its own at the last step
    assert held_out == [(1, 0, 0), (3, 2, 2), (5, 4, 4), (6, 6, 6)], held_out
    assert all(r["timing/validation_wait_s"] >= 0 for r in rows if "val/version" in r and r["step"] < 6)
