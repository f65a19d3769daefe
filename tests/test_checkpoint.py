"""Learner checkpoints (DCP, single process on CPU): round trip, atomicity, retention, resume bookkeeping,
and the Hugging Face export (transformers here, vLLM in the `vllm`-marked test)."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import random
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch
from batch_utils import ready_group

from rlbus.config import load_config
from rlbus.learner import checkpoint as ck
from rlbus.learner.batch import collate
from rlbus.learner.data import PromptLoader, load_split
from rlbus.learner.dispatch import Dispatcher, Ledger, prompt_seed
from rlbus.learner.export import export_hf
from rlbus.learner.trainer import PolicyTrainer
from rlbus.messages import PromptWork, ReadyGroup, Sample, SamplingParams, ScoredGroup, TrajectoryGroup
from rlbus.modeling import load_causal_lm, load_tokenizer, response_logprobs
from rlbus.tiny_model import default_model_path

torch.set_num_threads(1)
OVERRIDES = [
    "actor.optim.lr=1e-3",
    "actor.optim.lr_warmup_steps=3",
    "actor.optim.lr_scheduler=cosine",
    "algorithm.kl_ctrl.type=adaptive",
    "actor.optim.weight_decay=0.01",
]


_group = partial(ready_group, logprob=-1.5)


def _batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    tok = lambda n: torch.randint(3, 40, (n,), generator=g).tolist()  # noqa: E731
    groups = [
        _group(tok(4), [tok(3), tok(2), tok(4)], [1.0, 0.0, 0.0]),
        _group(tok(3), [tok(2), tok(5)], [0.0, 1.0]),
    ]
    return collate(groups, pad_id=0)


def _trainer(overrides: list[str] = OVERRIDES) -> PolicyTrainer:
    cfg = load_config(None, overrides)
    return PolicyTrainer(cfg, default_model_path(), torch.device("cpu"), total_steps=10)


def _weights(trainer: PolicyTrainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


@pytest.fixture(scope="module")
def trained() -> PolicyTrainer:
    torch.manual_seed(0)
    t = _trainer()
    for s in range(2):
        t.train_step(_batch(s))
    t.kl_ctrl.value = 0.0123  # as if the adaptive controller had moved
    return t


def test_round_trip_restores_model_optimizer_scheduler_rng_and_loader(
    trained: PolicyTrainer, tmp_path: Path
) -> None:
    records = load_split(load_config(None, ["data.num_train_examples=40"]).data, "train")
    loader = PromptLoader(records, seed=3)
    for _ in range(53):  # past an epoch boundary
        loader.next()
    torch.manual_seed(11)
    np.random.seed(12)
    random.seed(13)
    path = ck.save_checkpoint(
        ck.step_dir(tmp_path, 2), trained, {"step": 2, "loader": loader.state_dict(), "policy_version": 2}
    )
    expected_draws = (torch.rand(3), np.random.rand(3), random.random())
    expected_next = [loader.next().prompt for _ in range(5)]

    torch.manual_seed(99)
    np.random.seed(99)
    random.seed(99)
    fresh = _trainer()
    extra = ck.load_checkpoint(path, fresh)
    assert extra["step"] == 2 and extra["policy_version"] == 2
    for k, v in _weights(trained).items():
        assert torch.equal(fresh.model.state_dict()[k], v), k
    a, b = trained.optimizer.state_dict(), fresh.optimizer.state_dict()
    assert a["state"].keys() == b["state"].keys() and len(a["state"]) > 0
    for i, st in a["state"].items():
        for name, val in st.items():
            assert torch.equal(torch.as_tensor(b["state"][i][name]), torch.as_tensor(val)), (i, name)
    assert [g["lr"] for g in a["param_groups"]] == [g["lr"] for g in b["param_groups"]]
    assert fresh.scheduler.state_dict() == trained.scheduler.state_dict()
    assert fresh.scheduler.get_last_lr() == trained.scheduler.get_last_lr()
    assert fresh.kl_ctrl.value == pytest.approx(0.0123)
    got = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(got[0], expected_draws[0]) and np.array_equal(got[1], expected_draws[1])
    assert got[2] == expected_draws[2]
    resumed = PromptLoader(records, seed=3)
    resumed.load_state_dict(extra["loader"])
    assert [resumed.next().prompt for _ in range(5)] == expected_next

    # The strongest check: the next update from the restored state equals the next update from the original.
    twin = _trainer()
    ck.load_checkpoint(path, twin)
    ma, mb = twin.train_step(_batch(5)), fresh.train_step(_batch(5))
    assert ma["actor/lr"] == mb["actor/lr"]
    for k, v in twin.model.state_dict().items():
        assert torch.equal(fresh.model.state_dict()[k], v), k


def test_crash_while_saving_leaves_nothing_resume_would_load(
    trained: PolicyTrainer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = ck.checkpoint_root(tmp_path)
    ck.save_checkpoint(ck.step_dir(root, 3), trained, {"step": 3})
    real = ck._write_json

    def crash_at_marker(path: Path, obj) -> None:
        if path.name == ck.COMPLETE_MARKER:
            raise KeyboardInterrupt("killed while saving")
        real(path, obj)

    monkeypatch.setattr(ck, "_write_json", crash_at_marker)
    with pytest.raises(KeyboardInterrupt):
        ck.save_checkpoint(ck.step_dir(root, 6), trained, {"step": 6})
    monkeypatch.setattr(ck, "_write_json", real)
    assert (root / "global_step_6.tmp" / "state" / ".metadata").is_file()  # all but the marker was written
    assert not (root / "global_step_6").exists()
    # a hand-made wreck too: a step dir without its marker (e.g. copied by hand, half done)
    (root / "step_9").mkdir()
    (root / "step_9" / "meta.json").write_text("{")
    assert ck.latest_checkpoint(root) == root / "global_step_3"
    assert ck.resume_target(tmp_path, "auto") == root / "global_step_3"
    with pytest.raises(ck.CheckpointError, match="incomplete"):
        ck.resume_target(tmp_path, str(root / "step_9"))
    with pytest.raises(ck.CheckpointError):
        ck.load_checkpoint(root / "global_step_6.tmp", _trainer())
    assert ck.resume_target(tmp_path, "disable") is None
    assert not root.exists(), "a fresh start moves earlier checkpoints aside"
    aside = next(tmp_path.glob("checkpoints.superseded-*"))
    assert ck.latest_checkpoint(aside) == aside / "global_step_3"

    # the next save replaces a leftover tmp dir; pruning removes stale ones
    ck.save_checkpoint(ck.step_dir(aside, 6), trained, {"step": 6})
    assert ck.latest_checkpoint(aside) == aside / "global_step_6"
    assert not (aside / "global_step_6.tmp").exists()


def test_retention_keeps_the_newest_and_a_resave_replaces(trained: PolicyTrainer, tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    for step in (2, 4, 6, 8):
        ck.save_checkpoint(ck.step_dir(root, step), trained, {"step": step})
        ck.prune_checkpoints(root, keep=2)
    (root / "step_1.tmp").mkdir()
    ck.prune_checkpoints(root, keep=2)
    assert sorted(p.name for p in root.iterdir()) == ["global_step_6", "global_step_8"]
    ck.save_checkpoint(ck.step_dir(root, 8), trained, {"step": 8, "again": True})
    assert ck.read_meta(root / "global_step_8")["extra"]["again"] is True
    assert sorted(p.name for p in root.iterdir()) == ["global_step_6", "global_step_8"]
    assert [s for s, _ in ck.list_checkpoints(root)] == [6, 8]
    assert ck.resolve_checkpoint(tmp_path) == root / "global_step_8"  # a run dir resolves to its latest


def test_a_step_n_folder_of_an_earlier_version_is_still_resumed(
    trained: PolicyTrainer, tmp_path: Path
) -> None:
    """Checkpoints are verl's `global_step_N` now; an earlier rlbus's `step_N` is listed and loads."""
    root = ck.checkpoint_root(tmp_path)
    ck.save_checkpoint(ck.step_dir(root, 4), trained, {"step": 4})
    assert ck.step_dir(root, 4).name == "global_step_4"
    (root / "global_step_4").rename(root / "step_4")
    assert ck.resume_target(tmp_path, "auto") == root / "step_4"
    assert ck.load_checkpoint(root / "step_4", _trainer())["step"] == 4


def test_ledger_reconciles_in_flight_work_on_resume() -> None:
    ledger = Ledger()
    for i in range(8):
        ledger.dispatched[f"r-p{i}"] = i
    for i in (0, 1, 2, 4):
        ledger.trained[f"r-p{i}"] = 0
    ledger.dropped["r-p3"] = "stale"
    saved = Ledger.from_dict(json.loads(json.dumps(ledger.to_dict())))
    assert saved == ledger
    again = saved.settle_for_resume()
    assert again == [5, 6, 7]
    assert saved.in_flight == 0 and saved.dropped_count("resumed") == 3
    assert set(saved.dispatched) == set(saved.trained) | set(saved.dropped)


class _FakeBus:
    def __init__(self) -> None:
        self.sent: list[tuple[str, PromptWork]] = []

    async def publish(self, stage, work, msg_id: str) -> None:
        self.sent.append((msg_id, work))


def test_dispatcher_redispatches_first_with_new_ids_and_per_prompt_seeds() -> None:
    cfg = load_config(
        None,
        [
            "data.num_train_examples=20",
            "data.train_batch_size=3",
            "trainer.async_level=0",
            "rollout.seed_per_prompt=true",
            "rollout.seed=5",
            "run.id=r",
        ],
    )
    records = load_split(cfg.data, "train")
    tok = load_tokenizer(default_model_path())
    reference = PromptLoader(records, seed=cfg.data.seed)
    prompts = [reference.next().prompt for _ in range(10)]

    loader = PromptLoader(records, seed=cfg.data.seed, position=6)
    ledger = Ledger()
    bus = _FakeBus()
    d = Dispatcher(cfg, loader, tok, bus, ledger)
    d.id_tag = "a1-"
    d.requeue.extend([4, 5])
    asyncio.run(d.top_up(version=2, step=2, buffered=0))
    assert [w.index for _, w in bus.sent] == [4, 5, 6]
    assert [m for m, _ in bus.sent] == ["r-a1-p4", "r-a1-p5", "r-a1-p6"]
    assert [w.prompt_text for _, w in bus.sent] == prompts[4:7]
    assert [w.sampling.seed for _, w in bus.sent] == [prompt_seed(5, i) for i in (4, 5, 6)]
    assert loader.position == 7 and ledger.dispatched == {"r-a1-p4": 4, "r-a1-p5": 5, "r-a1-p6": 6}
    assert {w.min_policy_version for _, w in bus.sent} == {2}


def test_rewind_metrics_moves_the_lost_steps_aside(tmp_path: Path) -> None:
    rows = [{"step": s, "x": s} for s in (1, 2, 3, 4, 5)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 6, "x"')
    assert ck.rewind_metrics(tmp_path, 3) == 2
    kept = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    gone = [json.loads(line)["step"] for line in (tmp_path / ck.SUPERSEDED_METRICS).read_text().splitlines()]
    assert kept == [1, 2, 3] and gone == [4, 5]


def _rows(tok) -> tuple[list[list[int]], list[list[int]]]:
    prompts = [tok.encode(s, add_special_tokens=False) for s in ("12+34=", "7+8=", "55+21=")]
    responses = [tok.encode(s, add_special_tokens=False) for s in ("46", "15<", "76")]
    return prompts, responses


def test_export_hf_loads_in_transformers_with_the_learners_logprobs(
    trained: PolicyTrainer, tmp_path: Path
) -> None:
    from rlbus.cli import main

    tok = load_tokenizer(default_model_path())
    path = ck.save_checkpoint(ck.step_dir(tmp_path / "checkpoints", 2), trained, {"step": 2}, tokenizer=tok)
    out = export_hf(path, tmp_path / "hf")
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()
    assert (out / "config.json").is_file()
    with pytest.raises(FileExistsError):
        export_hf(path, out)
    assert main(["export-hf", str(tmp_path), str(tmp_path / "hf_cli")]) == 0  # the CLI, from a run dir

    restored = _trainer()
    ck.load_checkpoint(path, restored)
    restored.model.eval()
    prompts, responses = _rows(tok)
    want = response_logprobs(restored.model, prompts, responses, tok.pad_token_id)
    base = load_causal_lm(default_model_path(), "float32", "cpu")
    for d in (out, tmp_path / "hf_cli"):
        model = load_causal_lm(d, "float32", "cpu")
        got = response_logprobs(model, prompts, responses, load_tokenizer(d).pad_token_id)
        for g, w in zip(got, want, strict=True):
            np.testing.assert_allclose(g, w, atol=1e-6)
    before = response_logprobs(base, prompts, responses, tok.pad_token_id)
    assert max(float(np.abs(a - b).max()) for a, b in zip(before, want, strict=True)) > 1e-3, (
        "training moved it"
    )


@pytest.mark.vllm
@pytest.mark.timeout(600)
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed (make install)")
def test_export_hf_loads_in_vllm_with_the_learners_logprobs(trained: PolicyTrainer, tmp_path: Path) -> None:
    from rlbus.rollout.engines.vllm_engine import VLLMEngine

    tok = load_tokenizer(default_model_path())
    path = ck.save_checkpoint(ck.step_dir(tmp_path / "checkpoints", 2), trained, {"step": 2}, tokenizer=tok)
    out = export_hf(path, tmp_path / "hf")
    restored = _trainer()
    ck.load_checkpoint(path, restored)
    restored.model.eval()
    prompts, responses = _rows(tok)
    want = response_logprobs(restored.model, prompts, responses, tok.pad_token_id)
    engine = VLLMEngine(out, dtype="float32", max_num_seqs=8, seed=0, block_size=32)
    try:
        got = [engine.score(p, r, 1.0) for p, r in zip(prompts, responses, strict=True)]
    finally:
        engine.close()
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, atol=1e-4)


def test_ppo_critic_survives_a_checkpoint(tmp_path) -> None:
    """A resumed PPO run continues with the trained value model, not a fresh zero head."""
    import numpy as np
    import torch

    from rlbus.config import load_config
    from rlbus.learner.batch import collate
    from rlbus.learner.checkpoint import load_checkpoint, save_checkpoint
    from rlbus.learner.trainer import PolicyTrainer
    from rlbus.messages import PromptWork
    from rlbus.tiny_model import default_model_path

    cfg = load_config(None, ["algorithm.adv_estimator=gae", "critic.optim.lr=1e-2"])
    work = PromptWork(
        run_id="r",
        prompt_id="p",
        index=0,
        step=0,
        min_policy_version=0,
        prompt_ids=[3, 4, 5],
        n=2,
        sampling=SamplingParams(),
    )
    samples = [Sample(response_ids=r, logprobs=np.full(len(r), -1.0, np.float32)) for r in ([6, 7], [8])]
    traj = TrajectoryGroup(work=work, samples=samples, policy_version=0, replica_id="x", engine="hf")
    batch = collate(
        [ReadyGroup(scored=ScoredGroup(trajectories=traj, rewards=[1.0, 0.0], correct=[True, False]))], 0
    )
    trained = PolicyTrainer(cfg, default_model_path(), torch.device("cpu"), total_steps=4)
    trained.train_step(batch)
    save_checkpoint(tmp_path / "step_1", trained, {"step": 1})
    fresh = PolicyTrainer(cfg, default_model_path(), torch.device("cpu"), total_steps=4)
    assert not torch.allclose(fresh.critic.values(batch), trained.critic.values(batch))
    load_checkpoint(tmp_path / "step_1", fresh)
    assert torch.allclose(fresh.critic.values(batch), trained.critic.values(batch))
    assert (
        fresh.critic.scheduler.state_dict()["last_epoch"]
        == trained.critic.scheduler.state_dict()["last_epoch"]
    )


def test_lora_final_export_holds_the_merged_weights(tmp_path) -> None:
    """With LoRA the exported directory is a plain model with the adapters merged in, not an adapter."""
    import torch

    from rlbus.config import load_config
    from rlbus.learner.export import save_hf
    from rlbus.learner.model import full_state_items
    from rlbus.learner.trainer import PolicyTrainer
    from rlbus.modeling import load_causal_lm, load_tokenizer, response_logprobs
    from rlbus.tiny_model import default_model_path

    trainer = PolicyTrainer(
        load_config(None, ["model.lora_rank=4", "model.lora_alpha=8"]),
        default_model_path(),
        torch.device("cpu"),
        total_steps=2,
    )
    with torch.no_grad():
        for name, p in trainer.model.named_parameters():
            if "lora_B" in name:
                p.add_(torch.randn_like(p) * 0.05)
    out = save_hf(trainer.model, load_tokenizer(default_model_path()), tmp_path / "final")
    merged = load_causal_lm(default_model_path())
    merged.load_state_dict(dict(full_state_items(trainer.model)))
    exported, base = load_causal_lm(out), load_causal_lm(default_model_path())
    prompts, responses = [[5, 6, 7]], [[8, 9, 10]]
    got = response_logprobs(exported, prompts, responses, 0)[0]
    assert abs(got - response_logprobs(merged, prompts, responses, 0)[0]).max() < 1e-6
    assert abs(got - response_logprobs(base, prompts, responses, 0)[0]).max() > 1e-3
