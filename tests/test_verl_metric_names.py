"""verl's metric names beside ours, at verl's steps: a run's metrics.jsonl carries critic/score/mean,
response_length/mean, actor/pg_loss, perf/throughput, timing_s/* in every training row, and verl's
validation `val-core/<data_source>/reward/mean@1` in a row of its own at the validated policy's step: 0 for
val_before_train, N after N updates."""

from __future__ import annotations

from pathlib import Path

import pytest
from e2e_utils import Run, make_config
from test_verl_data import chat_model, verl_rows, write_parquet

from rlbus.verl_metric_names import is_validation_row, with_verl_names


def test_with_verl_names_adds_verls_names_and_keeps_ours() -> None:
    row = with_verl_names({"reward/mean": 0.5, "actor/approx_kl": 0.01, "timing/step_s": 1.0, "x": 1})
    assert row["critic/score/mean"] == 0.5 and row["actor/ppo_kl"] == 0.01 and row["timing_s/step"] == 1.0
    assert row["reward/mean"] == 0.5 and row["x"] == 1
    assert is_validation_row({"step": 0, "time": 1.0, "val-core/openai/gsm8k/reward/mean@1": 0.3})
    assert not is_validation_row({"step": 1, "val-core/a/reward/mean@1": 0.3, "reward/mean": 0.1})


@pytest.mark.timeout(240)
def test_validation_is_logged_at_verls_step(nats_url: str, run_id: str, tmp_path: Path) -> None:
    train = write_parquet(verl_rows(64), tmp_path / "train.parquet")
    val = write_parquet(verl_rows(8, seed=1), tmp_path / "test.parquet")
    cfg = make_config(
        nats_url,
        run_id,
        tmp_path,
        [
            f"actor_rollout_ref.model.path={chat_model(tmp_path)}",
            f"data.train_files={train}",
            f"data.val_files={val}",
            "reward.gsm8k_method=flexible",
            "data.train_batch_size=8",
            "rollout.n=2",
            "trainer.total_training_steps=4",
            "trainer.test_freq=2",
            "trainer.val_before_train=true",
            "data.max_prompt_length=16",
        ],
    )
    with Run(cfg) as run:
        assert run.wait_learner(200) == 0, run.logs("learner")
        rows = run.metrics()
    name = "val-core/openai/gsm8k/reward/mean@1"
    assert sorted(r["step"] for r in rows if name in r) == [0, 2, 4]  # before training, after 2, at the end
    assert all(is_validation_row(r) for r in rows if name in r and r["step"] < 4)
    training = [r for r in rows if "actor/pg_loss" in r]
    assert [r["step"] for r in training] == [1, 2, 3, 4]
    for row in training:
        for verl_name in ("critic/score/mean", "response_length/mean", "perf/throughput", "timing_s/step"):
            assert verl_name in row, verl_name


def test_memory_gauges_carry_verls_names_and_the_gpu_ones_only_on_a_gpu() -> None:
    """The learner logs verl's memory gauges with each step: this process's resident memory everywhere, the GPU's
    peaks and the caching allocator's retries only where it trains on a GPU."""
    import psutil
    import torch

    from rlbus.learner.step_metrics import memory_metrics

    cpu = memory_metrics(torch.device("cpu"))
    assert set(cpu) == {"perf/cpu_memory_used_gb"}
    assert 0 < cpu["perf/cpu_memory_used_gb"] <= psutil.virtual_memory().total / 1024**3
    if torch.cuda.is_available():
        gpu = memory_metrics(torch.device("cuda"))
        gauges = {"perf/max_memory_allocated_gb", "perf/max_memory_reserved_gb", "perf/alloc_retries"}
        assert gauges <= set(gpu)
