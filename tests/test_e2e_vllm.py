"""End-to-end GRPO with `rollout.name=vllm`: reward, vLLM rollout replicas and the learner as separate OS processes
over a real NATS server, on CPU (vllm-cpu), the bundled tiny model.

(a) async_level=0: after the first push, the replica's behaviour log-probs at policy version 1 are the learner's
    log-probs for the weights it checkpointed (<= 1e-4), and differ from version 0's: the push changed the model to
    exactly the learner's. Run once per vLLM process layout (in-process, the CPU default; and vLLM's
    multiprocess layout, the GPU default).
(b) async_level=1, two replicas: greedy validation accuracy rises, staleness stays bounded, the on-policy
    first step's mismatch between learner and behaviour log-probs is ~0.

Each replica starts its own vLLM engine (~25-60 s on a 2-core box); `VLLM_CPU_KVCACHE_SPACE=1` keeps each at
~1.8 GB. Every test checks that no vLLM process outlives its replica.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch
from e2e_utils import Run, checkpoint_weights, make_config, rollout_groups

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None, reason="vllm is not installed (make install)"
    ),
]

ATOL = 1e-4  # fp32 on CPU: vLLM's and transformers' kernels sum in different orders (measured ~1e-6)
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}
LAYOUTS = {"in_process": "0", "multiprocess": "1"}  # -> VLLM_ENABLE_V1_MULTIPROCESSING for the replica


def _descendants(run: Run) -> list[psutil.Process]:
    out: list[psutil.Process] = []
    for p in run.procs:
        if p.proc is not None and p.alive:
            try:
                out += psutil.Process(p.proc.pid).children(recursive=True)
            except psutil.Error:
                pass
    return out


@contextmanager
def running(run: Run) -> Iterator[Run]:
    """`with run:` that also checks that no process a service started (vLLM's engine core, workers) outlives it."""
    run.__enter__()
    seen: list[psutil.Process] = []
    try:
        yield run
    finally:
        seen = _descendants(run)  # while the services still run
        run.__exit__(None, None, None)
        _, alive = psutil.wait_procs(seen, timeout=20)
        for p in alive:  # children of the services this test started: end them, then fail
            p.kill()
    assert not alive, f"processes left behind by the services: {[(p.pid, p.name()) for p in alive]}"


def _mean(rows: list[dict], key: str) -> float:
    return float(np.mean([r[key] for r in rows]))


def _model_logprobs(
    model: torch.nn.Module, prompt: list[int], response: list[int], temperature: float
) -> np.ndarray:
    """log_softmax(logits / T) of each response token, the convention of every engine (T = 1 for greedy)."""
    t = temperature if temperature > 0 else 1.0
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, :-1].float()
    lp = torch.log_softmax(logits / t, -1).gather(-1, ids[0, 1:, None])[:, 0]
    return lp[len(prompt) - 1 :].numpy()


def _worst(model: torch.nn.Module, groups: list[list[dict]]) -> float:
    worst = 0.0
    for g in groups:
        for s in g:
            lp = _model_logprobs(model, s["prompt_ids"], s["response_ids"], s["temperature"])
            assert len(lp) == len(s["logprobs"])
            if len(lp):
                worst = max(worst, float(np.abs(lp - np.asarray(s["logprobs"])).max()))
    return worst


@pytest.mark.timeout(600)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_sync_first_push_gives_the_learners_logprobs(
    nats_url: str, run_id: str, tmp_path: Path, layout: str
) -> None:
    """async_level=0 with vLLM: version-1 behaviour log-probs == the learner's for its checkpointed weights."""
    cfg = make_config(
        nats_url,
        run_id,
        tmp_path,
        [
            "rollout.name=vllm",
            "trainer.async_level=0",
            "rollout.replicas=1",
            "trainer.total_training_steps=2",
            "data.train_batch_size=4",
            "rollout.n=4",
            f"trainer.rollout_data_dir={tmp_path / 'rollouts'}",
            "trainer.save_freq=1",
            "actor.optim.lr=1e-3",
            "actor.optim.grad_clip=1e9",
            "trainer.seed=7",
            "trainer.test_freq=-1",
            "trainer.val_before_train=false",
            "trainer.batch_timeout_s=300",
        ],
    )
    run = Run(cfg)
    run.proc("rollout-0").env.update({**VLLM_ENV, "VLLM_ENABLE_V1_MULTIPROCESSING": LAYOUTS[layout]})
    with running(run):
        assert run.wait_learner(500) == 0, run.logs("learner") + "\n" + run.logs("rollout-0")
        rows = run.metrics()
        replica_log = run.logs("rollout-0", tail=100_000)
    assert "weights updated" in replica_log
    if layout == "multiprocess":
        assert "EngineCore" in replica_log  # vLLM's engine core ran in its own process
    groups0 = rollout_groups(tmp_path / "rollouts", 1)  # what step 1 trained on
    groups1 = rollout_groups(tmp_path / "rollouts", 2)
    assert {s["policy_version"] for g in groups0 for s in g} == {0}
    assert {s["policy_version"] for g in groups1 for s in g} == {1}, "async_level=0 is on-policy"
    assert {s["engine"] for g in groups0 + groups1 for s in g} == {"vllm"}
    assert sum(len(s["response_ids"]) for g in groups1 for s in g) > 0

    from transformers import AutoModelForCausalLM

    from rlbus.tiny_model import default_model_path

    model = AutoModelForCausalLM.from_pretrained(default_model_path(), dtype=torch.float32).eval()
    assert _worst(model, groups0) < ATOL, "version 0: behaviour log-probs differ from the initial model's"
    stale = _worst(model, groups1)  # version 1's samples under the OLD weights: the push must show
    model.load_state_dict(checkpoint_weights(run.run_dir, 1))
    worst = _worst(model.eval(), groups1)
    assert worst < ATOL, f"after the push, replica log-probs differ from the learner's new weights by {worst}"
    assert stale > 30 * ATOL, f"the push hardly changed the replica's log-probs ({stale})"

    train = [r for r in rows if "actor/mismatch_kl" in r]
    assert [r["step"] for r in train] == [1, 2]
    print(
        json.dumps(
            {
                "layout": layout,
                "max_abs_diff_v1": worst,
                "max_abs_change_by_push": stale,
                "mismatch_kl": [r["actor/mismatch_kl"] for r in train],
            }
        )
    )
    for r in train:  # the learner's own view: old (its recompute) - behaviour (the replica's), on-policy
        assert abs(r["actor/mismatch_kl"]) < 1e-5, r
        assert r["actor/is_weight_mean"] == pytest.approx(1.0, abs=1e-4), r


@pytest.mark.timeout(600)
def test_async_grpo_vllm_two_replicas_accuracy_rises(nats_url: str, run_id: str, tmp_path: Path) -> None:
    steps = 150
    cfg = make_config(
        nats_url,
        run_id,
        tmp_path,
        [
            "rollout.name=vllm",
            "trainer.async_level=1",
            "rollout.replicas=2",
            f"trainer.total_training_steps={steps}",
            "data.train_batch_size=16",
            "rollout.n=8",
            f"trainer.test_freq={steps // 3}",
            "trainer.val_before_train=true",
            "data.val_batch_size=128",
            "trainer.batch_timeout_s=300",
            "actor.optim.lr_scheduler=cosine",  # keeps the gain to the end (see test_e2e_grpo)
        ],
    )
    run = Run(cfg)
    for p in run.procs:
        if p.service == "rollout":
            p.env.update(VLLM_ENV)
    with running(run):
        rc = run.wait_learner(480)
        assert rc == 0, run.logs("learner")
        rows = run.metrics()
        logs = {p.name: run.logs(p.name, tail=100_000) for p in run.procs if p.service == "rollout"}
    train = [r for r in rows if "reward/accuracy" in r]
    val = [r["val/accuracy"] for r in rows if "val/accuracy" in r]
    assert len(train) == steps and len(val) >= 4, val  # before training, then every steps/3
    # Greedy accuracy on 128 held-out prompts: the warm start gets ~51%, 150 steps ~70% (measured +0.19..0.23);
    # a random-direction update does not add 12 points (one evaluation's standard error is ~4.4 points).
    assert val[-1] > val[0] + 0.12, f"val accuracy {val}"
    # Sampled (T=0.7) accuracy rises less and plateaus (~0.39 -> ~0.46 over 150 steps): 25-step means.
    start, end = _mean(train[:25], "reward/accuracy"), _mean(train[-25:], "reward/accuracy")
    assert end > start + 0.03, f"sampled accuracy {start:.3f} -> {end:.3f}"
    assert max(r["staleness/max"] for r in train) <= 1
    assert any(r.get("staleness/hist_1", 0) > 0 for r in train), "async_level=1 never overlapped"
    assert all(np.isfinite(r["actor/loss"]) for r in train)
    # Step 1 trains version-0 samples with version-0 weights: learner and vLLM agree on every log-prob.
    assert abs(train[0]["actor/mismatch_kl"]) < 1e-5, train[0]
    assert train[0]["actor/is_weight_mean"] == pytest.approx(1.0, abs=1e-4)
    for name, text in logs.items():
        assert "weights updated" in text, f"{name} never took a push"
    print(
        json.dumps(
            {
                "val": val,
                "mismatch_kl_step1": train[0]["actor/mismatch_kl"],
                "mismatch_kl": [round(r["actor/mismatch_kl"], 6) for r in train],
            }
        )
    )
