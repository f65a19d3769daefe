"""The learner's pieces without the bus: collation, one update, the data order."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from batch_utils import ready_group

from rlbus.config import load_config
from rlbus.learner.batch import collate
from rlbus.learner.data import PromptLoader, load_split
from rlbus.learner.optim import lr_lambda
from rlbus.learner.trainer import PolicyTrainer
from rlbus.tiny_model import default_model_path


def test_collate_aligns_response_mask_with_next_token_positions() -> None:
    batch = collate([ready_group([5, 6, 7], [[8, 9], [10]], [1.0, 0.0])], pad_id=0)
    assert batch.input_ids.tolist() == [[5, 6, 7, 8, 9], [5, 6, 7, 10, 0]]
    # position t predicts token t+1: responses start predicting at t = len(prompt) - 1 = 2
    assert batch.response_mask.tolist() == [[0, 0, 1, 1], [0, 0, 1, 0]]
    assert batch.behaviour_logprobs[0, 2:].tolist() == [-1.0, -1.0]
    assert batch.group_ids.tolist() == [0, 0]


def test_data_order_is_seeded_and_resumable() -> None:
    cfg = load_config(None, ["data.num_train_examples=50"])
    records = load_split(cfg.data, "train")
    a = PromptLoader(records, seed=1)
    first = [a.next().prompt for _ in range(70)]  # crosses an epoch boundary
    b = PromptLoader(records, seed=1)
    b.load_state_dict({"position": 30, "seed": 1})
    assert [b.next().prompt for _ in range(40)] == first[30:]
    # a prompt dispatched again is the one handed out at its position, from either epoch, and moves nothing
    assert [(b.at(i).index, b.at(i).prompt) for i in (65, 3, 49, 50)] == [
        (i, first[i]) for i in (65, 3, 49, 50)
    ]
    assert b.position == 70
    assert (
        PromptLoader(records, seed=2).next().prompt != first[0]
        or PromptLoader(records, seed=3).next().prompt != first[0]
    )


def test_lr_schedule_warmup_then_cosine() -> None:
    assert lr_lambda(0, 4, 20, "cosine", 0.0) == pytest.approx(0.25)
    assert lr_lambda(4, 4, 20, "cosine", 0.0) == pytest.approx(1.0)
    assert lr_lambda(20, 4, 20, "cosine", 0.1) == pytest.approx(0.1)
    assert lr_lambda(10, 0, 20, "constant", 0.0) == 1.0


@pytest.mark.parametrize(
    "overrides",
    [
        [],
        ["actor.policy_loss=gspo", "actor.loss_agg_mode=seq-mean-token-mean"],
        ["actor.policy_loss=dual_clip", "actor.ppo_epochs=2", "actor.ppo_mini_batch_size=1"],
        ["algorithm.adv_estimator=rloo", "actor.ppo_micro_batch_size=1"],
        ["algorithm.adv_estimator=reinforce_plus_plus"],
        ["algorithm.adv_estimator=dr_grpo", "actor.loss_agg_mode=seq-mean-token-sum-norm"],
        ["algorithm.adv_estimator=grpo", "actor.ppo_mini_batch_size=1", "actor.clip_ratio_high=0.28"],
    ],
)
def test_one_update_changes_weights_and_reports_finite_metrics(overrides: list[str]) -> None:
    torch.manual_seed(0)
    cfg = load_config(None, ["actor.optim.lr=1e-3", *overrides])
    trainer = PolicyTrainer(cfg, default_model_path(), torch.device("cpu"), total_steps=10)
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    groups = [
        ready_group([3, 4, 5], [[6, 7], [8], [9, 10, 11]], [1.0, 0.0, 0.0]),
        ready_group([12, 13], [[14], [15, 16]], [0.0, 1.0]),
    ]
    metrics = trainer.train_step(collate(groups, pad_id=0))
    assert all(np.isfinite(v) for v in metrics.values()), metrics
    changed = any(not torch.equal(before[k], v) for k, v in trainer.model.state_dict().items())
    assert changed
    assert metrics["actor/grad_norm"] > 0


def test_gsm8k_jsonl_keeps_the_final_answer(tmp_path) -> None:
    import json

    path = tmp_path / "gsm.jsonl"
    path.write_text(json.dumps({"question": "2+2?", "answer": "Add them.\n#### 1,004"}) + "\n")
    cfg = load_config(None, ["data.task=jsonl", f"data.train_files=[{path}]", "data.prompt_key=question"])
    [(prompt, meta)] = load_split(cfg.data, "train")
    assert prompt == "2+2?" and meta["answer"] == "1004" and meta["task"] == "gsm8k"


def test_ledger_drops_dead_lettered_prompts_of_its_own_only() -> None:
    from rlbus.learner.dispatch import DEAD_LETTERED, Ledger

    ledger = Ledger(dispatched={"p1": 0, "p2": 1, "p3": 2}, trained={"p3": 0})
    assert ledger.settle_dead_letter("p1") == "p1"  # the prompt itself, parked by a replica
    assert ledger.settle_dead_letter("p2:traj") == "p2"  # what became of it, parked downstream
    assert ledger.settle_dead_letter("p3:scored") is None  # already trained: not ours to drop
    assert ledger.settle_dead_letter("intruder") is None  # never dispatched by us
    assert ledger.dropped == {"p1": DEAD_LETTERED, "p2": DEAD_LETTERED}
    assert ledger.in_flight == 0 and ledger.dropped_count(DEAD_LETTERED) == 2


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_compiled_layers_compile_at_warm_up_only_whatever_the_widths(packed: bool, device: str) -> None:
    """actor.use_torch_compile (on by default on CUDA for a model of 10M parameters or more): the learner's
    warm-up compiles the decoder layers on placeholder batches without touching the weights; every step after
    it, at any prompt and response width, padded or packed, with rows of unequal or of one length (those
    reach the layers without a mask), reuses those graphs (dynamo counts none new), so no step pauses for a
    compile. On a GPU inductor's kernels also guard on the sequence axis's alignment and on size thresholds
    (each was a recompile in a GPU run's first step): the last step is a large batch of odd lengths."""
    from torch._dynamo.utils import counters

    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    torch._dynamo.reset()
    cfg = load_config(
        None,
        ["actor.optim.lr=1e-5", "actor.use_torch_compile=true", f"model.use_remove_padding={packed}"]
        + ["data.max_prompt_length=16", "data.max_response_length=300"]
        + (["model.dtype=bfloat16"] if device == "cuda" else []),
    )
    trainer = PolicyTrainer(cfg, default_model_path(), torch.device(device), total_steps=10)
    before = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    start = counters["stats"]["unique_graphs"]
    assert trainer.compiles_layers and trainer.warm_up()
    warmed = counters["stats"]["unique_graphs"]
    assert warmed > start, "the warm-up compiled the layers"
    assert all(torch.equal(v, before[k]) for k, v in trainer.model.state_dict().items())
    assert all(p.grad is None for p in trainer.model.parameters())
    rng = np.random.default_rng(0)
    graphs = []
    for step in range(7):
        equal = step in (4, 5)  # every row of one length (13, then 16 tokens): no padding anywhere
        prompt_len = 7 + 3 * (step - 4)
        longest = 300 if step == 6 else 8 + 6 * step
        groups = [
            ready_group(
                rng.integers(5, 40, size=prompt_len if equal else int(rng.integers(3, 12))).tolist(),
                [
                    rng.integers(5, 40, size=6 if equal else int(rng.integers(1, longest))).tolist()
                    for _ in range(4)
                ],
                [1.0, 0.0, 0.0, 1.0],
            )
            for _ in range(16 if step == 6 else 4)
        ]
        trainer.train_step(collate(groups, pad_id=0))
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs == [warmed] * 7, graphs


def test_layers_compile_by_default_only_on_a_gpu_for_a_model_whose_compile_pays() -> None:
    from rlbus.learner.model import compiles_layers

    cfg, cuda, cpu = load_config(None, []), torch.device("cuda"), torch.device("cpu")
    assert compiles_layers(cfg, cuda, 500_000_000) and compiles_layers(cfg, cuda, 10_000_000)
    assert not compiles_layers(cfg, cuda, 300_000), "the bundled demo model: the compile never pays"
    assert not compiles_layers(cfg, cpu, 500_000_000)
    assert not compiles_layers(load_config(None, ["model.use_liger=true"]), cuda, 500_000_000)
    assert compiles_layers(load_config(None, ["actor.use_torch_compile=true"]), cpu, 300_000), "as asked"
