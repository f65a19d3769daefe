"""Every file in configs/ loads through the real loader (verl key names included) and says what it claims."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from rlbus.config import load_config

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
FILES = sorted(CONFIGS.glob("*.yaml")) + sorted(CONFIGS.glob("*.yml"))


def test_there_are_example_configs() -> None:
    names = {p.name for p in FILES}
    for expected in (
        "grpo_addition.yaml",
        "ppo_gae_addition.yaml",
        "rloo_addition.yaml",
        "reinforce_pp_addition.yaml",
        "dapo_addition.yaml",
        "gspo_addition.yaml",
        "grpo_gsm8k.yaml",
        "dpo_example.yaml",
        "kto_example.yaml",
        "simpo_example.yaml",
    ):
        assert expected in names


@pytest.mark.parametrize("path", FILES, ids=[p.name for p in FILES])
def test_config_loads(path: Path) -> None:
    cfg = load_config(path, [])
    assert cfg.run.id, path


def test_configs_mean_what_their_names_say() -> None:
    def load(name: str):
        return load_config(CONFIGS / name, [])

    assert load("ppo_gae_addition.yaml").algorithm.adv_estimator == "gae"
    assert load("rloo_addition.yaml").algorithm.adv_estimator == "rloo"
    assert load("reinforce_pp_addition.yaml").algorithm.adv_estimator == "reinforce_plus_plus"
    dapo = load("dapo_addition.yaml")
    assert (dapo.actor.clip_ratio_low, dapo.actor.clip_ratio_high) == (0.2, 0.28)
    assert dapo.algorithm.dynamic_sampling and dapo.actor.loss_agg_mode == "token-mean"
    gspo = load("gspo_addition.yaml")
    assert gspo.actor.policy_loss == "gspo" and gspo.actor.clip_ratio_high < 0.01
    gsm8k = load("grpo_gsm8k.yaml")
    assert gsm8k.data.task == "jsonl" and gsm8k.data.train_files
    assert gsm8k.model.path is not None  # set through actor_rollout_ref.model.path
    for algo in ("dpo", "kto", "simpo"):
        assert load(f"{algo}_example.yaml").preference.algorithm == algo
    assert load("grpo_addition.yaml").preference.algorithm == "none"


def test_config_show_cli_accepts_every_file() -> None:
    """`rlbus config show --config FILE` (what the configs' comments tell people to run), in one fresh
    interpreter for all files: the same entry point without paying an interpreter start per file."""
    script = (
        "import sys\n"
        "from rlbus.cli import main\n"
        "for path in sys.argv[1:]:\n"
        "    rc = main(['config', 'show', '--config', path])\n"
        "    if rc:\n"
        "        sys.exit(f'{path}: rc {rc}')\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script, *map(str, FILES)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("preference:") == len(FILES)
