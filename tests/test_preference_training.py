"""Offline preference training end to end on the bundled tiny model: DPO raises the held-out margin and
accuracy, KTO and SimPO train without NaNs in the right direction, `rlbus train` works as a command, and the
ref service gives the same reference log-probs as the local path.

The data is the synthetic addition set (correct sum over the same sum with one digit off by one). Sizes are
small so the file stays well under a minute and a half on two shared CPU cores.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from rlbus.config import load_config
from rlbus.learner.preference import main as pm
from rlbus.learner.preference import reference
from rlbus.learner.preference.dataset import (
    make_synthetic_preferences,
    pair_batch,
    read_records,
    tokenize_pairs,
    tokenize_unpaired,
    unpair,
    write_jsonl,
)
from rlbus.learner.preference.reference import ref_logps
from rlbus.modeling import load_causal_lm, load_tokenizer, response_logprobs
from rlbus.tasks import get_task
from rlbus.tiny_model import default_model_path

torch.set_num_threads(2)

ROOT = Path(__file__).resolve().parents[1]
# 96 pairs x 4 epochs = 24 steps of 16 pairs; 64 held-out pairs from the task's val split.
SMALL = [
    "trainer.logger=[jsonl]",
    "trainer.test_freq=-1",
    "preference.synthetic_train_examples=96",
    "preference.synthetic_val_examples=64",
    "preference.batch_size=16",
    "preference.micro_batch_size=8",
    "preference.epochs=4",
    "preference.lr=4e-5",
    "preference.max_length=32",
    "trainer.device=cpu",
]


def _cfg(tmp_path: Path, *overrides: str):
    return load_config(None, [f"run.dir={tmp_path / 'runs'}", "run.id=pref", *SMALL, *overrides])


def _train_rows(tmp_path: Path) -> list[dict]:
    rows = [
        json.loads(line) for line in (tmp_path / "runs" / "pref" / "metrics.jsonl").read_text().splitlines()
    ]
    return [r for r in rows if "train/loss" in r]


def _epoch_mean(rows: list[dict], key: str, epoch: int) -> float:
    values = [r[key] for r in rows if r["train/epoch"] == epoch]
    return sum(values) / len(values)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(default_model_path())


# --------------------------------------------------------------------------------------------------
# data


def test_synthetic_pairs_differ_in_one_digit_and_roundtrip(tmp_path: Path, tokenizer) -> None:
    path = tmp_path / "prefs.jsonl"
    rows = make_synthetic_preferences(get_task("addition"), 50, seed=3, path=path)
    assert rows == make_synthetic_preferences(get_task("addition"), 50, seed=3)  # deterministic
    assert read_records([path]) == rows
    val_prompts = {r["prompt"] for r in make_synthetic_preferences(get_task("addition"), 50, 3, split="val")}
    assert not val_prompts & {r["prompt"] for r in rows}  # held out for real
    for r in rows:
        a, b = r["prompt"].rstrip("=").split("+")
        assert r["chosen"] == str(int(a) + int(b))
        assert len(r["rejected"]) == len(r["chosen"]) and not r["rejected"].startswith("0")
        diffs = [(x, y) for x, y in zip(r["chosen"], r["rejected"], strict=True) if x != y]
        assert len(diffs) == 1 and abs(int(diffs[0][0]) - int(diffs[0][1])) in (1, 9)

    pairs = tokenize_pairs(rows, tokenizer, max_length=16)
    eos = tokenizer.eos_token_id
    assert pairs[0].chosen_ids[-1] == eos and pairs[0].rejected_ids[-1] == eos
    assert all(len(p.prompt_ids) + len(p.chosen_ids) <= 16 for p in pairs)
    assert all(
        len(p.prompt_ids) + len(p.rejected_ids) <= 7 for p in tokenize_pairs(rows, tokenizer, max_length=7)
    )
    short = tokenize_pairs(rows[:1], tokenizer, max_length=4)[0]  # the prompt keeps its end, "=" included
    assert tokenizer.decode(short.prompt_ids) == rows[0]["prompt"][-3:] and len(short.chosen_ids) == 1
    batch = pair_batch(pairs[:3], tokenizer.pad_token_id)
    assert batch.size == 3 and batch.sequences.input_ids.shape[0] == 6
    assert batch.sequences.response_mask[:3].sum(-1).tolist() == [len(p.chosen_ids) for p in pairs[:3]]
    unpaired = unpair(pairs[:2])
    assert [u.desirable for u in unpaired] == [True, False, True, False]


def test_kto_rows_from_a_user_file_train(tmp_path: Path, tokenizer) -> None:
    """A user's unpaired JSONL (prompt/completion/label, labels in the spellings people use), held out by
    eval_fraction, through one short KTO run."""
    rows = [
        {"prompt": f"{a}+{a}=", "completion": str(2 * a + (i % 2)), "label": ["true", False][i % 2]}
        for i, a in enumerate(range(10, 34))
    ]
    path = write_jsonl(rows, tmp_path / "kto.jsonl")
    examples = tokenize_unpaired(read_records([path]), tokenizer, max_length=32)
    assert [e.desirable for e in examples[:4]] == [True, False, True, False]
    cfg = _cfg(
        tmp_path,
        "preference.algorithm=kto",
        f"preference.train_files=[{path}]",
        "preference.eval_fraction=0.25",
        "preference.max_steps=2",
        "preference.save_model=false",
    )
    summary = pm.train_preference(cfg)
    assert summary["steps"] == 2
    assert set(summary["after"]) >= {"eval/margin", "eval/accuracy", "eval/rewards_chosen"}
    paired = _cfg(tmp_path, "preference.algorithm=dpo", f"preference.train_files=[{path}]")
    assert pm.run_preference(paired) == 2  # DPO on unpaired rows: a clear error, not a traceback


# --------------------------------------------------------------------------------------------------
# training


def test_dpo_raises_held_out_margin_and_accuracy(tmp_path: Path) -> None:
    summary = pm.train_preference(_cfg(tmp_path, "preference.algorithm=dpo", "preference.save_model=false"))
    before, after = summary["before"], summary["after"]
    print("DPO held-out", {k: (round(before[k], 4), round(after[k], 4)) for k in before})
    # before training policy == reference: every implicit reward is 0 (up to float noise)
    assert abs(before["eval/margin"]) < 1e-4 and abs(before["eval/rewards_chosen"]) < 1e-4
    assert after["eval/margin"] > before["eval/margin"] + 0.05
    assert after["eval/accuracy"] >= 0.55 and after["eval/accuracy"] > before["eval/accuracy"] + 0.25
    assert after["eval/loss"] < before["eval/loss"]
    train = _train_rows(tmp_path)
    assert len(train) == summary["steps"] == 24
    assert _epoch_mean(train, "train/margin", 3) > _epoch_mean(train, "train/margin", 0)
    assert _epoch_mean(train, "train/accuracy", 3) > _epoch_mean(train, "train/accuracy", 0)


def test_kto_trains_without_nans_in_the_right_direction(tmp_path: Path) -> None:
    summary = pm.train_preference(
        _cfg(tmp_path, "preference.algorithm=kto", "preference.epochs=2", "preference.save_model=false")
    )
    before, after = summary["before"], summary["after"]
    print("KTO held-out", {k: (round(before[k], 4), round(after[k], 4)) for k in before})
    train = _train_rows(tmp_path)
    assert len(train) == 24  # 96 pairs -> 192 unpaired examples, 2 epochs of 16
    assert all(
        torch.isfinite(torch.tensor([r["train/loss"], r["train/kl"], r["train/margin"]])).all() for r in train
    )
    assert after["eval/margin"] > before["eval/margin"] + 0.03
    assert after["eval/accuracy"] > before["eval/accuracy"] + 0.2
    assert _epoch_mean(train, "train/loss", 1) < _epoch_mean(train, "train/loss", 0)


def test_simpo_trains_without_a_reference(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_reference(*args, **kwargs):
        raise AssertionError("SimPO is reference-free: no reference log-probs may be computed")

    monkeypatch.setattr(reference, "ref_logps", no_reference)
    summary = pm.train_preference(_cfg(tmp_path, "preference.algorithm=simpo", "preference.save_model=false"))
    before, after = summary["before"], summary["after"]
    print("SimPO held-out", {k: (round(before[k], 4), round(after[k], 4)) for k in before})
    train = _train_rows(tmp_path)
    for key in ("train/loss", "train/margin", "train/grad_norm"):
        assert all(torch.isfinite(torch.tensor(r[key])) for r in train), key
    # SimPO's reward is beta * the average log-prob itself: it starts from the model's own preference
    assert before["eval/margin"] > 0 and before["eval/accuracy"] == before["eval/policy_accuracy"]
    assert _epoch_mean(train, "train/loss", 3) < _epoch_mean(train, "train/loss", 0)
    assert _epoch_mean(train, "train/margin", 3) > _epoch_mean(train, "train/margin", 0)
    assert after["eval/loss"] < before["eval/loss"] + 0.05  # held out: at least no collapse


# --------------------------------------------------------------------------------------------------
# the command and the ref service


def test_rlbus_train_cli_writes_metrics_and_a_loadable_model(tmp_path: Path) -> None:
    cmd = [
        sys.executable,
        "-m",
        "rlbus.cli",
        "train",
        "--config",
        str(ROOT / "configs" / "dpo_example.yaml"),
        f"run.dir={tmp_path}",
        "run.id=cli",
        "preference.max_steps=3",
        "preference.synthetic_train_examples=24",
        "preference.synthetic_val_examples=8",
        "trainer.logger=[console,jsonl]",
        "trainer.device=cpu",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "[train] step 3/3" in proc.stdout and "[eval] step 3/3" in proc.stdout
    run_dir = tmp_path / "cli"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "train/loss" in r] == [1, 2, 3]
    assert [r["step"] for r in rows if "eval/margin" in r] == [0, 3]
    assert json.loads((run_dir / "preference_summary.json").read_text())["steps"] == 3

    trained = load_causal_lm(run_dir / "model")
    tok = load_tokenizer(run_dir / "model")
    original = load_causal_lm(default_model_path())
    ids = tok("12+34=", add_special_tokens=False)["input_ids"]
    answer = tok("46", add_special_tokens=False)["input_ids"]
    new = response_logprobs(trained, [ids], [answer], tok.pad_token_id)[0]
    old = response_logprobs(original, [ids], [answer], tok.pad_token_id)[0]
    assert new.shape == old.shape == (2,) and not (new == old).all()  # the saved weights are the trained ones


def test_ref_service_gives_the_local_reference_logprobs(tmp_path: Path, nats_url: str, run_id: str) -> None:
    """ref_source=service: the pairs travel to a real `rlbus ref` process over NATS and come back with
    the reference log-probs the local path computes (same model, same `rlbus.modeling` code)."""
    overrides = [
        f"run.id={run_id}",
        f"run.dir={tmp_path / 'runs'}",
        f"bus.url={nats_url}",
        "trainer.device=cpu",
        "preference.algorithm=dpo",
        "preference.ref_timeout_s=90",
        "logging.level=warning",
    ]
    cfg_path = tmp_path / "ref.yaml"
    from rlbus.config import save_config

    save_config(load_config(None, overrides), cfg_path)
    ref_proc = subprocess.Popen(
        [sys.executable, "-m", "rlbus.cli", "ref", "--config", str(cfg_path)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    try:
        tok = load_tokenizer(default_model_path())
        rows = make_synthetic_preferences(get_task("addition"), 6, seed=5)
        pairs = tokenize_pairs(rows, tok, max_length=32)
        seqs = [(p.prompt_ids, c) for p in pairs for c in (p.chosen_ids, p.rejected_ids)]
        cfg = load_config(None, [*overrides, "preference.ref_source=service"])
        remote = ref_logps(cfg, seqs, torch.device("cpu"), print)
        local = ref_logps(load_config(None, overrides), seqs, torch.device("cpu"), print)
    finally:
        ref_proc.terminate()
        try:
            _, err = ref_proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            ref_proc.kill()
            _, err = ref_proc.communicate()
    assert len(remote) == len(local) == 12, err
    for r, loc, (_, comp) in zip(remote, local, seqs, strict=True):
        assert r.shape == (len(comp),)
        torch.testing.assert_close(torch.from_numpy(r), torch.from_numpy(loc), atol=1e-5, rtol=0)


TRL_DPO_YAML = """\
model_name_or_path: {model}
dataset_name: {data}
learning_rate: 4.0e-5
num_train_epochs: 1
max_steps: 3
per_device_train_batch_size: 2
gradient_accumulation_steps: 4
gradient_checkpointing: false
logging_steps: 1
eval_strategy: steps
eval_steps: 3
beta: 0.1
loss_type: sigmoid
max_length: 64
output_dir: {out}
report_to: none
no_remove_unused_columns: true
"""


def test_trl_dpo_yaml_runs_through_scripts_train_dpo(tmp_path: Path) -> None:
    """TRL's `trl dpo --config` YAML, as its docs write it (local model and data: nothing downloads)."""
    from rlbus.config import load_config
    from rlbus.config.trl_dpo import trl_dpo_overrides

    data = tmp_path / "prefs.jsonl"
    rows = [{"prompt": f"{a}+{a}=", "chosen": str(2 * a), "rejected": str(2 * a + 1)} for a in range(10, 30)]
    data.write_text("\n".join(json.dumps(r) for r in rows))
    text = TRL_DPO_YAML.format(model=default_model_path(), data=data, out=tmp_path / "runs" / "trl-dpo")
    (tmp_path / "dpo.yaml").write_text(text)
    overrides, inert = trl_dpo_overrides(yaml.safe_load(text))
    cfg = load_config(None, overrides)
    p = cfg.preference
    assert (p.algorithm, p.micro_batch_size, p.batch_size, p.max_steps, p.lr) == ("dpo", 2, 8, 3, 4e-5)
    assert p.train_files == [data] and cfg.run.id == "trl-dpo" and cfg.trainer.test_freq == 3
    assert set(inert) == {"eval_strategy", "report_to", "no_remove_unused_columns"}
    cmd = [sys.executable, str(ROOT / "scripts" / "train_dpo.py"), "--config", str(tmp_path / "dpo.yaml")]
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    proc = subprocess.run([*cmd, "trainer.device=cpu"], capture_output=True, text=True, timeout=180, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "report_to has no effect here" in proc.stderr
    run_dir = tmp_path / "runs" / "trl-dpo"
    assert json.loads((run_dir / "preference_summary.json").read_text())["steps"] == 3
    with pytest.raises(ValueError, match="loss_type"):
        trl_dpo_overrides({"loss_type": "robust"})
