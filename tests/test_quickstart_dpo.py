"""The users' quick start's DPO YAML (../shared/seeds/verl-quick-start.txt, section 3.2, quoted verbatim
below) means one thing: every key maps onto ours with its documented meaning or is named at start as
having no effect, and the file trains the model it names through `python scripts/train_dpo.py --config`
and `rlbus train --config` alike (here with only the model path overridden to the bundled tiny model)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rlbus.config import ConfigError, load_config
from rlbus.config.loader import flatten
from rlbus.config.quickstart_preference import INERT, quickstart_keys
from rlbus.tiny_model import default_model_path

ROOT = Path(__file__).resolve().parents[1]

QUICKSTART_DPO_YAML = """\
algorithm: dpo
train_batch_size: 256
seq_len: 512
gradient_accumulation_steps: 8
model:
  path: "meta-llama/Llama-3.2-1B"
  enable_gradient_checkpointing: true
  use_remove_padding: true
actor_rollout_ref:
  actor:
    fsdp_config:
      fsdp_size: -1
      param_offload: true
      optimizer_offload: true
      wrap_policy:
        transformer_layer_cls_to_wrap: ["LlamaDecoderLayer"]
        min_num_params: 100000000
    optim_config:
      name: adamw
      lr: 5e-6
      weight_decay: 0.01
  rollout:
    name: "vllm"
    tensor_model_parallel_size: 1
  ref:
    fsdp_config:
      param_offload: true
"""

# every key of the file -> (our key, value) it sets, or None: named at start as having no effect
EXPECTED: dict[str, tuple[str, object] | None] = {
    "algorithm": ("preference.algorithm", "dpo"),
    "train_batch_size": ("preference.batch_size", 256),
    "seq_len": ("preference.max_length", 512),
    "gradient_accumulation_steps": ("preference.micro_batch_size", 32),  # 256 pairs a step in 8 passes
    "model.path": ("model.path", Path("meta-llama/Llama-3.2-1B")),
    "model.enable_gradient_checkpointing": ("model.enable_gradient_checkpointing", True),
    "model.use_remove_padding": ("model.use_remove_padding", True),
    "actor_rollout_ref.actor.fsdp_config.fsdp_size": None,  # -1: every rank, as rlbus shards anyway
    "actor_rollout_ref.actor.fsdp_config.param_offload": ("actor.param_offload", True),
    "actor_rollout_ref.actor.fsdp_config.optimizer_offload": ("actor.optimizer_offload", True),
    "actor_rollout_ref.actor.fsdp_config.wrap_policy.transformer_layer_cls_to_wrap": None,
    "actor_rollout_ref.actor.fsdp_config.wrap_policy.min_num_params": None,
    "actor_rollout_ref.actor.optim_config.name": None,  # adamw: the trainer's optimizer
    "actor_rollout_ref.actor.optim_config.lr": ("preference.lr", 5e-6),
    "actor_rollout_ref.actor.optim_config.weight_decay": ("preference.weight_decay", 0.01),
    "actor_rollout_ref.rollout.name": None,
    "actor_rollout_ref.rollout.tensor_model_parallel_size": None,
    "actor_rollout_ref.ref.fsdp_config.param_offload": None,
}


def _get(cfg: object, dotted: str) -> object:
    for part in dotted.split("."):
        cfg = getattr(cfg, part)
    return cfg


def test_every_key_of_the_quickstart_dpo_yaml_has_its_meaning(tmp_path: Path) -> None:
    raw = yaml.safe_load(QUICKSTART_DPO_YAML)
    assert set(flatten(raw)) == set(EXPECTED)
    path = tmp_path / "dpo_example.yaml"
    path.write_text(QUICKSTART_DPO_YAML)
    cfg = load_config(path)
    _, inert = quickstart_keys(flatten(raw))
    for key, expected in EXPECTED.items():
        if expected is None:
            assert key in inert or key.endswith(("fsdp_size", "optim_config.name")), key
            continue
        ours, value = expected
        assert _get(cfg, ours) == value, key
    for key in inert:
        assert key in cfg.inert_keys and any(key.startswith(k.rstrip(".")) for k in INERT), key


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        ("gradient_accumulation_steps: 8", "gradient_accumulation_steps: 7"),
        ("name: adamw", "name: sgd"),
        ("fsdp_size: -1", "fsdp_size: 2"),
    ],
)
def test_a_value_that_would_mean_something_else_is_refused(tmp_path: Path, line: str, reason: str) -> None:
    path = tmp_path / "dpo.yaml"
    path.write_text(QUICKSTART_DPO_YAML.replace(line, reason))
    with pytest.raises(ConfigError, match=reason.split(":")[0]):
        load_config(path)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("entry", ["scripts/train_dpo.py", "rlbus train"])
def test_the_quickstart_dpo_yaml_trains_through_both_entry_points(tmp_path: Path, entry: str) -> None:
    path = tmp_path / "dpo_example.yaml"
    path.write_text(QUICKSTART_DPO_YAML)
    head = (
        [sys.executable, str(ROOT / "scripts/train_dpo.py")]
        if entry.startswith("scripts")
        else [sys.executable, "-m", "rlbus.cli", "train"]
    )
    overrides = [f"model.path={default_model_path()}", f"run.dir={tmp_path / 'runs'}", "run.id=qs-dpo"]
    done = subprocess.run(
        [*head, "--config", str(path), *overrides], capture_output=True, text=True, timeout=540, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr[-3000:]
    run_dir = tmp_path / "runs" / "qs-dpo"
    resolved = yaml.safe_load((run_dir / "config.yaml").read_text())
    pref = resolved["preference"]
    assert (pref["algorithm"], pref["batch_size"], pref["micro_batch_size"], pref["lr"]) == (
        "dpo",
        256,
        32,
        5e-6,
    )
    assert (pref["max_length"], pref["weight_decay"]) == (512, 0.01)
    assert resolved["model"]["enable_gradient_checkpointing"] is True
    summary = json.loads((run_dir / "preference_summary.json").read_text())
    assert summary  # trained and evaluated
    assert (run_dir / "model" / "config.json").is_file()
    assert "actor_rollout_ref.rollout.name has no effect here" in done.stderr


@pytest.mark.timeout(600)
def test_rlbus_own_dpo_example_means_the_same_through_the_script(tmp_path: Path) -> None:
    """configs/dpo_example.yaml is an rlbus config: the script runs it as `rlbus train --config` does."""
    example = ROOT / "configs" / "dpo_example.yaml"
    overrides = [f"run.dir={tmp_path / 'runs'}", "run.id=example", "preference.max_steps=2"]
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts/train_dpo.py"), "--config", str(example), *overrides],
        capture_output=True,
        text=True,
        timeout=540,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    resolved = yaml.safe_load((tmp_path / "runs" / "example" / "config.yaml").read_text())
    want = load_config(example, overrides)
    assert resolved["preference"] == want.model_dump(mode="json")["preference"]
    assert resolved["preference"]["lr"] == 4.0e-5  # the file's, not a default
