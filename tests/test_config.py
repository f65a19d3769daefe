"""Config: YAML < env < CLI precedence, verl spellings, clear errors naming the key."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

from rlbus.config import ConfigError, load_config
from rlbus.config.loader import canonical_key


def test_defaults_are_the_embedded_demo() -> None:
    cfg = load_config()
    assert cfg.rollout.name == "hf"
    assert cfg.model.path is None  # the bundled tiny model
    assert cfg.bus.url is None  # start or find a local NATS


def test_dotted_overrides_and_verl_spellings() -> None:
    cfg = load_config(
        None,
        [
            "data.train_batch_size=64",
            "actor_rollout_ref.model.path=/x",
            "actor_rollout_ref.rollout.name=vllm",
            "actor_rollout_ref.actor.optim.lr=3e-6",
            "algorithm.kl_ctrl.kl_coef=0.05",
            "trainer.total_epochs=2",
            "trainer.save_freq=10",
            "trainer.test_freq=5",
            "trainer.val_before_train=true",
            "trainer.logger=['console','wandb']",
            "trainer.n_gpus_per_node=8",
            "trainer.nnodes=2",
            "actor_rollout_ref.rollout.n=4",
        ],
    )
    assert cfg.data.train_batch_size == 64
    assert str(cfg.model.path) == "/x"
    assert cfg.rollout.name == "vllm" and cfg.rollout.n == 4
    assert cfg.actor.optim.lr == pytest.approx(3e-6)
    assert cfg.algorithm.kl_ctrl.kl_coef == pytest.approx(0.05)
    assert cfg.trainer.total_epochs == 2 and cfg.trainer.save_freq == 10 and cfg.trainer.test_freq == 5
    assert cfg.trainer.val_before_train is True
    assert cfg.trainer.logger == ["console", "wandb"]
    assert cfg.trainer.n_gpus_per_node == 8 and cfg.trainer.nnodes == 2


def test_canonical_key_mapping() -> None:
    assert canonical_key("actor_rollout_ref.model.path") == "model.path"
    assert canonical_key("actor_rollout_ref.rollout.response_length") == "data.max_response_length"
    assert canonical_key("critic.model.path") == "critic.model_path"
    assert canonical_key("data.seed") == "data.seed"


def test_yaml_then_env_then_cli(tmp_path, monkeypatch) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "data": {"train_batch_size": 8, "seed": 3},
                "actor_rollout_ref": {"rollout": {"n": 2}, "model": {"path": "/from/yaml"}},
                "rollout": {"temperature": 0.5},
            }
        )
    )
    cfg = load_config(path)
    assert cfg.data.train_batch_size == 8 and cfg.rollout.n == 2 and str(cfg.model.path) == "/from/yaml"
    monkeypatch.setenv("RLBUS_DATA__TRAIN_BATCH_SIZE", "16")
    monkeypatch.setenv("RLBUS_ROLLOUT__TEMPERATURE", "0.9")
    cfg = load_config(path)
    assert cfg.data.train_batch_size == 16  # env beats YAML
    assert cfg.data.seed == 3  # untouched YAML keys survive the merge
    assert cfg.rollout.temperature == pytest.approx(0.9)
    cfg = load_config(path, ["data.train_batch_size=32"])
    assert cfg.data.train_batch_size == 32  # CLI beats env


def test_bad_value_names_the_key() -> None:
    with pytest.raises(ConfigError, match=r"data\.train_batch_size"):
        load_config(None, ["data.train_batch_size=abc"])


def test_unknown_key_lists_allowed_keys() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, ["data.train_batch_sise=4"])
    assert "data.train_batch_sise: unknown key" in str(info.value)
    assert "train_batch_size" in str(info.value)


def test_bad_choice_lists_allowed_values() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, ["rollout.name=trt"])
    assert "rollout.name" in str(info.value) and "'vllm'" in str(info.value)


def test_cross_field_rule() -> None:
    with pytest.raises(ConfigError, match="reward.function"):
        load_config(None, ["reward.type=function"])


def test_override_syntax_error() -> None:
    with pytest.raises(ConfigError, match="section.key=value"):
        load_config(None, ["data.train_batch_size"])


def _rlbus(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rlbus.cli", *args], capture_output=True, text=True, timeout=60
    )


def test_cli_config_show_applies_overrides() -> None:
    out = _rlbus("config", "show", "data.train_batch_size=64", "actor_rollout_ref.model.path=/x")
    assert out.returncode == 0, out.stderr
    shown = yaml.safe_load(out.stdout)
    assert shown["data"]["train_batch_size"] == 64
    assert shown["model"]["path"] == "/x"


def test_cli_config_show_rejects_bad_value() -> None:
    out = _rlbus("config", "show", "data.train_batch_size=abc")
    assert out.returncode != 0
    assert "data.train_batch_size" in out.stderr


def test_version() -> None:
    out = subprocess.run(
        [sys.executable, "-c", "import rlbus; print(rlbus.__version__)"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 0 and out.stdout.strip()


def test_replica_weight_wait_stays_below_the_learner_batch_timeout() -> None:
    """Neither side may outwait the other: a replica holding work gives it back before the learner stalls."""
    assert load_config(None, ["trainer.batch_timeout_s=120"]).weight_wait_s == 60.0
    assert load_config(None, ["rollout.weight_wait_timeout_s=30"]).weight_wait_s == 30.0
    with pytest.raises(
        ConfigError, match=r"rollout\.weight_wait_timeout_s=300 must be below trainer\.batch_timeout_s"
    ):
        load_config(None, ["rollout.weight_wait_timeout_s=300", "trainer.batch_timeout_s=300"])


def test_every_config_key_says_what_it_does() -> None:
    from rlbus.config import RlbusConfig
    from rlbus.config.doc import undocumented_keys

    assert undocumented_keys(RlbusConfig) == []


def test_config_show_doc_prints_each_key_with_its_value_and_meaning() -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "rlbus.cli",
            "config",
            "show",
            "--doc",
            "actor.ppo_epochs=3",
            "bus.password=s3cret",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    assert "actor.ppo_epochs = 3  # passes over each batch" in out
    assert "# actor.optim: the policy's optimiser and schedule" in out
    assert "s3cret" not in out
