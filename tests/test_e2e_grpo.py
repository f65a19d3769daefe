"""End-to-end GRPO over a real NATS server, with the four services as separate OS processes."""

from __future__ import annotations

import signal
from pathlib import Path

import numpy as np
import pytest
import torch
from e2e_utils import Run, checkpoint_weights, make_config, rollout_groups


def _mean(rows: list[dict], key: str) -> float:
    return float(np.mean([r[key] for r in rows]))


# The one GRPO accuracy run (150 steps, ~2-3 min): in `make test-slow` with the other accuracy runs.
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_async_grpo_two_replicas_accuracy_rises(nats_url: str, run_id: str, tmp_path: Path) -> None:
    cfg = make_config(
        nats_url,
        run_id,
        tmp_path,
        [
            "trainer.async_level=1",
            "rollout.replicas=2",
            "trainer.total_training_steps=150",
            "data.train_batch_size=16",
            "rollout.n=8",
            "trainer.test_freq=50",
            "trainer.val_before_train=true",
            "data.val_batch_size=256",
            "data.num_val_examples=256",
            # With a constant lr greedy accuracy peaks near step 50 and drifts back (0.50 -> 0.71 -> 0.61 once);
            # cosine decay keeps the gain (0.50 -> 0.78/0.79 at the end in two runs).
            "actor.optim.lr_scheduler=cosine",
        ],
    )
    with Run(cfg) as run:
        rc = run.wait_learner(800)
        assert rc == 0, run.logs("learner")
        rows = run.metrics()
    train = [r for r in rows if "reward/accuracy" in r]
    val = [r["val/accuracy"] for r in rows if "val/accuracy" in r]
    assert len(train) == 150 and len(val) == 4  # before training, at steps 50 and 100, after the last step
    # Greedy accuracy on 256 held-out prompts: the warm start gets ~50%. A random-direction update
    # does not add 12 points (the standard error of one evaluation is ~3.1 points).
    assert val[-1] > val[0] + 0.12, f"val accuracy {val}"
    # Sampled (T=0.7) accuracy rises less (~0.39 -> ~0.48 in 25-step means; one mean's standard error is ~1.4
    # points), so its bar is lower and its windows wide enough that noise does not cross it.
    start, end = _mean(train[:25], "reward/accuracy"), _mean(train[-25:], "reward/accuracy")
    assert end > start + 0.03, f"sampled accuracy {start:.3f} -> {end:.3f}"
    assert max(r["staleness/max"] for r in train) <= 1
    assert all(np.isfinite(r["actor/loss"]) for r in train)
    assert {r["staleness/hist_1"] > 0 for r in train[5:] if "staleness/hist_1" in r} == {True}


@pytest.mark.timeout(600)
def test_killed_replica_loses_no_work(nats_url: str, run_id: str, tmp_path: Path) -> None:
    cfg = make_config(
        nats_url,
        run_id,
        tmp_path,
        [
            "trainer.async_level=1",
            "rollout.replicas=2",
            "trainer.total_training_steps=8",
            "data.train_batch_size=8",
            "rollout.n=4",
            "rollout.prompts_per_batch=4",
        ],
    )
    with Run(cfg) as run:
        run.wait_for_step(2, 300)
        victim = run.proc("rollout-1")
        assert victim.proc is not None
        victim.proc.send_signal(signal.SIGKILL)  # no goodbye: its held work must come back by redelivery
        victim.proc.wait(10)
        rc = run.wait_learner(400)
        assert rc == 0, run.logs("learner")
        ledger = run.ledger()
    dispatched = set(ledger["dispatched"])
    trained, dropped = set(ledger["trained"]), set(ledger["dropped"])
    assert len(trained) == 8 * 8
    assert trained.isdisjoint(dropped)
    assert dispatched == trained | dropped, "every dispatched prompt is trained on or explicitly dropped"


@pytest.mark.timeout(600)
def test_sync_first_update_matches_plain_loop(nats_url: str, run_id: str, tmp_path: Path) -> None:
    """async_level=0: the services' first update equals a single-process loop on the same batch."""
    # Adam's first step is sign(g)*lr, which turns rounding noise in near-zero gradient entries into
    # full-size differences; eps=1 makes the first step ~ lr*g (SGD-like), so the comparison is well posed.
    lr = 1.0
    cfg = make_config(
        nats_url,
        run_id,
        tmp_path,
        [
            "trainer.async_level=0",
            "rollout.replicas=1",
            "trainer.total_training_steps=2",
            "data.train_batch_size=4",
            "rollout.n=4",
            f"trainer.rollout_data_dir={tmp_path / 'rollouts'}",
            "trainer.save_freq=1",
            f"actor.optim.lr={lr}",
            "actor.optim.grad_clip=1e9",
            "actor.optim.eps=1.0",
            "trainer.seed=7",
        ],
    )
    with Run(cfg) as run:
        assert run.wait_learner(400) == 0, run.logs("learner")
        served = next(r for r in run.metrics() if r["step"] == 1 and "actor/pg_loss" in r)
    groups0 = rollout_groups(tmp_path / "rollouts", 1)  # what step 1 trained on
    groups1 = rollout_groups(tmp_path / "rollouts", 2)
    assert {s["policy_version"] for g in groups0 for s in g} == {0}
    assert {s["policy_version"] for g in groups1 for s in g} == {1}, "async_level=0 is on-policy"

    from transformers import AutoModelForCausalLM

    from rlbus.tiny_model import default_model_path

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(default_model_path(), dtype=torch.float32)
    model.train()
    temperature = groups0[0][0]["temperature"]  # log-probs of the sampling policy
    seqs, masks, advs = [], [], []
    for g in groups0:  # a plain GRPO loop, written out without the library's helpers
        r = torch.tensor([s["score"] for s in g], dtype=torch.float64)
        a = (r - r.mean()) / (r.std() + 1e-6) if len(r) > 1 else torch.zeros_like(r)
        for s, adv in zip(g, a, strict=True):
            seqs.append((s["prompt_ids"], s["response_ids"]))
            advs.append(float(adv))
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.999), eps=1.0, weight_decay=0.0)
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    total_tokens = sum(len(r) for _, r in seqs)
    loss_sum = torch.zeros(())
    for (p, r), adv in zip(seqs, advs, strict=True):
        ids = torch.tensor([p + r])
        logits = model(input_ids=ids).logits[0, :-1].float() / temperature
        lp = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0][len(p) - 1 :]
        ratio = torch.exp(lp - lp.detach())
        loss_sum = loss_sum + (-adv * ratio).sum() / total_tokens  # token-mean over the batch
        masks.append(len(r))
    loss_sum.backward()
    grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9))
    opt.step()
    got = checkpoint_weights(run.run_dir, 1)
    assert served["actor/pg_loss"] == pytest.approx(float(loss_sum.detach()), abs=1e-6)
    assert served["actor/grad_norm"] == pytest.approx(grad_norm, rel=1e-4)
    moved = max(float((param - initial[name]).abs().max()) for name, param in model.state_dict().items())
    assert moved > 1e-4, "the update must be big enough for the comparison to mean something"
    for name, param in model.state_dict().items():
        assert torch.allclose(got[name], param, atol=moved * 1e-2), name

    # After the push, the replica's behaviour log-probs are the learner's log-probs for the new weights.
    model.load_state_dict(got)
    model.eval()
    worst = 0.0
    with torch.no_grad():
        for g in groups1:
            for s in g:
                p = s["prompt_ids"]
                ids = torch.tensor([p + s["response_ids"]])
                lp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float() / temperature, -1)
                lp = lp.gather(-1, ids[0, 1:, None])[:, 0][len(p) - 1 :].numpy()
                worst = max(worst, float(np.abs(lp - np.asarray(s["logprobs"])).max()))
    assert worst < 1e-4, f"replica log-probs differ from the learner's by {worst}"
