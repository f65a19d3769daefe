"""Preference training (DPO) on the RL learner's model path: two torchrun ranks (gloo, CPU) train exactly
what one process trains, a SIGKILLed run resumes from its checkpoint to the same weights (both in make
test-slow: ~30 s each), and LoRA trains only the adapters."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlbus.config import load_config, save_config
from rlbus.learner.preference.main import total_steps
from rlbus.learner.preference.trainer import build_trainer, rank_shares
from rlbus.weight_sync import free_port

# 48 pairs, batches of 12 (6 per rank, micro-batches of 4: one rank runs a short second pass), 8 steps.
TINY = [
    "preference.algorithm=dpo",
    "trainer.logger=[jsonl]",
    "trainer.test_freq=-1",
    "trainer.device=cpu",
    "preference.synthetic_train_examples=56",
    "preference.synthetic_val_examples=8",
    "preference.eval_fraction=0.0",
    "preference.batch_size=12",
    "preference.micro_batch_size=4",
    "preference.epochs=2",
    "preference.max_steps=8",
    "preference.lr=1e-3",
    "preference.max_length=24",
]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _config(tmp_path: Path, run_id: str, *overrides: str) -> Path:
    cfg = load_config(None, [f"run.dir={tmp_path / 'runs'}", f"run.id={run_id}", *TINY, *overrides])
    path = tmp_path / f"{run_id}.yaml"
    save_config(cfg, path)
    return path


def _train_command(config: Path, ranks: int) -> list[str]:
    if ranks == 1:
        return [sys.executable, "-m", "rlbus.cli", "train", "--config", str(config)]
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    return [
        torchrun,
        f"--nproc-per-node={ranks}",
        f"--master-port={free_port()}",
        "-m",
        "rlbus.cli",
        "train",
        "--config",
        str(config),
    ]


def _losses(run_dir: Path) -> list[float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    return [r["train/loss"] for r in sorted((r for r in rows if "train/loss" in r), key=lambda r: r["step"])]


def _weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "model" / "model.safetensors"))


def _train(tmp_path: Path, run_id: str, ranks: int, *overrides: str) -> Path:
    proc = subprocess.run(
        _train_command(_config(tmp_path, run_id, *overrides), ranks),
        capture_output=True,
        text=True,
        timeout=400,
        env=ENV,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return tmp_path / "runs" / run_id


def test_rank_shares_deal_a_batch_evenly() -> None:
    assert rank_shares(list(range(7)), 2) == [[0, 1, 2, 3], [4, 5, 6]]
    assert rank_shares([5], 2) == [[5], []]
    assert sum(rank_shares(list(range(12)), 3), []) == list(range(12))


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_two_ranks_train_what_one_process_trains(tmp_path: Path) -> None:
    one = _train(tmp_path, "one", 1)
    two = _train(tmp_path, "two", 2)
    summary = json.loads((two / "preference_summary.json").read_text())
    assert summary["ranks"] == 2 and summary["steps"] == 8
    want, got = _losses(one), _losses(two)
    assert len(want) == len(got) == 8
    assert got == pytest.approx(want, rel=1e-4, abs=1e-6)
    a, b = _weights(one), _weights(two)
    assert a.keys() == b.keys()
    moved = max(float((a[k] - load_file_initial()[k]).abs().max()) for k in a)
    assert moved > 1e-3, "training must move the weights for the comparison to mean something"
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-4, atol=1e-5, msg=k)


def load_file_initial() -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    from rlbus.tiny_model import default_model_path

    model = AutoModelForCausalLM.from_pretrained(default_model_path(), dtype=torch.float32)
    return {k: v.detach() for k, v in model.state_dict().items()}


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_sigkilled_run_resumes_from_its_checkpoint_to_the_same_weights(tmp_path: Path) -> None:
    uninterrupted = _train(tmp_path, "calm", 1)
    config = _config(tmp_path, "killed", "trainer.save_freq=2")
    run_dir = tmp_path / "runs" / "killed"
    proc = subprocess.Popen(
        _train_command(config, 1), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=ENV
    )
    deadline = time.monotonic() + 300
    while not (run_dir / "checkpoints" / "global_step_4").exists():
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        assert time.monotonic() < deadline, "no step-4 checkpoint in 300 s"
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    assert not (run_dir / "model").exists(), "killed before the end: no final model yet"

    resumed = _train(tmp_path, "killed", 1, "trainer.save_freq=2")
    rows = [json.loads(line) for line in (resumed / "metrics.jsonl").read_text().splitlines() if line]
    assert sorted(r["step"] for r in rows if "train/loss" in r) == list(range(1, 9))  # each step once
    assert _losses(resumed) == pytest.approx(_losses(uninterrupted), rel=1e-5, abs=1e-7)
    a, b = _weights(uninterrupted), _weights(resumed)
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-5, atol=1e-6, msg=k)


def test_lora_trains_only_the_adapters(tmp_path: Path) -> None:
    cfg = load_config(
        None,
        [f"run.dir={tmp_path / 'runs'}", "run.id=lora", *TINY, "model.lora_rank=4", "model.lora_alpha=8"],
    )
    trainer, _ = build_trainer(cfg, tmp_path / "runs" / "lora", lambda n: total_steps(cfg.preference, n))
    named = dict(trainer.model.named_parameters())
    trainable = {k for k, p in named.items() if p.requires_grad}
    assert trainable and all("lora_" in k for k in trainable)
    before = {k: p.detach().clone() for k, p in named.items()}
    for _ in range(2):  # LoRA's B starts at zero: the second step is the first that moves A
        trainer.step(list(range(cfg.preference.batch_size)))
    changed = {k for k, p in named.items() if not torch.equal(p.detach(), before[k])}
    assert changed == trainable
