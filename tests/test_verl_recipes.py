"""verl's own command lines, quoted verbatim: every override is accepted, mapped onto our field with verl's
meaning or taken out with a start-up warning naming it. Sources: verl's docs/start/quickstart.rst (GSM8K PPO
quickstart) and examples/grpo_trainer/run_qwen2-7b.sh, run_qwen2_5-3b_gsm8k_grpo_lora.sh,
run_qwen2-7b_seq_balance.sh."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml

from rlbus.config import load_config
from rlbus.config.loader import canonical_key
from rlbus.config.warnings import inert_key_warnings

QUICKSTART = r"""
PYTHONUNBUFFERED=1 python3 -m verl.trainer.main_ppo \
 data.train_files=$HOME/data/gsm8k/train.parquet \
 data.val_files=$HOME/data/gsm8k/test.parquet \
 data.train_batch_size=256 \
 data.max_prompt_length=512 \
 data.max_response_length=512 \
 actor_rollout_ref.model.path=Qwen/Qwen2.5-0.5B-Instruct \
 actor_rollout_ref.actor.optim.lr=1e-6 \
 actor_rollout_ref.actor.ppo_mini_batch_size=64 \
 actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4 \
 actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8 \
 actor_rollout_ref.rollout.tensor_model_parallel_size=1 \
 actor_rollout_ref.rollout.gpu_memory_utilization=0.4 \
 actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4 \
 critic.optim.lr=1e-5 \
 critic.model.path=Qwen/Qwen2.5-0.5B-Instruct \
 critic.ppo_micro_batch_size_per_gpu=4 \
 algorithm.kl_ctrl.kl_coef=0.001 \
 trainer.logger=console \
 trainer.val_before_train=False \
 trainer.n_gpus_per_node=1 \
 trainer.nnodes=1 \
 trainer.save_freq=10 \
 trainer.test_freq=10 \
 trainer.total_epochs=15 2>&1 | tee verl_demo.log
"""

RUN_QWEN2_7B = r"""
python3 -m verl.trainer.main_ppo \
    algorithm.adv_estimator=grpo \
    data.train_files=$HOME/data/gsm8k/train.parquet \
    data.val_files=$HOME/data/gsm8k/test.parquet \
    data.train_batch_size=1024 \
    data.max_prompt_length=512 \
    data.max_response_length=1024 \
    data.filter_overlong_prompts=True \
    data.truncation='error' \
    actor_rollout_ref.model.path=Qwen/Qwen2-7B-Instruct \
    actor_rollout_ref.actor.optim.lr=1e-6 \
    actor_rollout_ref.model.use_remove_padding=True \
    actor_rollout_ref.actor.ppo_mini_batch_size=256 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=40 \
    actor_rollout_ref.actor.use_kl_loss=True \
    actor_rollout_ref.actor.kl_loss_coef=0.001 \
    actor_rollout_ref.actor.kl_loss_type=low_var_kl \
    actor_rollout_ref.actor.entropy_coeff=0 \
    actor_rollout_ref.model.enable_gradient_checkpointing=True \
    actor_rollout_ref.actor.fsdp_config.param_offload=False \
    actor_rollout_ref.actor.fsdp_config.optimizer_offload=False \
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=40 \
    actor_rollout_ref.rollout.tensor_model_parallel_size=2 \
    actor_rollout_ref.rollout.name=vllm \
    actor_rollout_ref.rollout.gpu_memory_utilization=0.6 \
    actor_rollout_ref.rollout.n=5 \
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=40 \
    actor_rollout_ref.ref.fsdp_config.param_offload=True \
    algorithm.use_kl_in_reward=False \
    trainer.critic_warmup=0 \
    trainer.logger=['console','wandb'] \
    trainer.project_name='verl_grpo_example_gsm8k' \
    trainer.experiment_name='qwen2_7b_function_rm' \
    trainer.n_gpus_per_node=8 \
    trainer.nnodes=1 \
    trainer.save_freq=20 \
    trainer.test_freq=5 \
    trainer.total_epochs=15 $@
"""

RUN_QWEN2_5_3B_LORA = r"""
python3 -m verl.trainer.main_ppo \
    algorithm.adv_estimator=grpo \
    trainer.val_before_train=False \
    data.train_files=$HOME/data/gsm8k/train.parquet \
    data.val_files=$HOME/data/gsm8k/test.parquet \
    data.train_batch_size=16 \
    data.max_prompt_length=512 \
    data.max_response_length=1024 \
    data.filter_overlong_prompts=True \
    data.truncation='error' \
    data.shuffle=False \
    actor_rollout_ref.model.path=Qwen/Qwen2.5-3B-Instruct \
    actor_rollout_ref.model.lora_rank=64 \
    actor_rollout_ref.model.lora_alpha=32 \
    actor_rollout_ref.actor.optim.lr=3e-6 \
    actor_rollout_ref.model.use_remove_padding=True \
    actor_rollout_ref.actor.ppo_mini_batch_size=16 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=40 \
    actor_rollout_ref.actor.use_kl_loss=True \
    actor_rollout_ref.actor.kl_loss_coef=0.001 \
    actor_rollout_ref.actor.kl_loss_type=low_var_kl \
    actor_rollout_ref.actor.entropy_coeff=0 \
    actor_rollout_ref.model.enable_gradient_checkpointing=True \
    actor_rollout_ref.actor.fsdp_config.param_offload=False \
    actor_rollout_ref.actor.fsdp_config.optimizer_offload=False \
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=40 \
    actor_rollout_ref.rollout.tensor_model_parallel_size=2 \
    actor_rollout_ref.rollout.name=vllm \
    actor_rollout_ref.rollout.gpu_memory_utilization=0.6 \
    actor_rollout_ref.rollout.n=5 \
    actor_rollout_ref.rollout.load_format=safetensors \
    actor_rollout_ref.rollout.layered_summon=True \
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=40 \
    actor_rollout_ref.ref.fsdp_config.param_offload=True \
    algorithm.use_kl_in_reward=False \
    trainer.critic_warmup=0 \
    trainer.logger='["console","wandb"]' \
    trainer.project_name='verl_grpo_example_gsm8k' \
    trainer.experiment_name='qwen2.5_3b_grpo_lora' \
    trainer.n_gpus_per_node=2 \
    trainer.nnodes=1 \
    trainer.save_freq=20 \
    trainer.test_freq=5 \
    trainer.total_epochs=15 $@
"""

RUN_QWEN2_7B_SEQ_BALANCE = r"""
python3 -m verl.trainer.main_ppo \
    algorithm.adv_estimator=grpo \
    data.train_files=$HOME/data/gsm8k/train.parquet \
    data.val_files=$HOME/data/gsm8k/test.parquet \
    data.return_raw_chat=$return_raw_chat \
    data.train_batch_size=1024 \
    data.max_prompt_length=512 \
    data.max_response_length=1024 \
    data.filter_overlong_prompts=True \
    data.truncation='error' \
    actor_rollout_ref.model.path=Qwen/Qwen2-7B-Instruct \
    actor_rollout_ref.actor.optim.lr=1e-6 \
    actor_rollout_ref.model.use_remove_padding=True \
    actor_rollout_ref.actor.ppo_mini_batch_size=256 \
    actor_rollout_ref.actor.use_dynamic_bsz=True \
    actor_rollout_ref.actor.ppo_max_token_len_per_gpu=24000 \
    actor_rollout_ref.actor.use_kl_loss=True \
    actor_rollout_ref.actor.kl_loss_coef=0.001 \
    actor_rollout_ref.actor.kl_loss_type=low_var_kl \
    actor_rollout_ref.actor.entropy_coeff=0 \
    actor_rollout_ref.model.enable_gradient_checkpointing=True \
    actor_rollout_ref.actor.fsdp_config.param_offload=False \
    actor_rollout_ref.actor.fsdp_config.optimizer_offload=False \
    actor_rollout_ref.rollout.tensor_model_parallel_size=2 \
    actor_rollout_ref.rollout.name=$rollout_name \
    actor_rollout_ref.rollout.mode=$rollout_mode \
    actor_rollout_ref.rollout.multi_turn.format=hermes \
    actor_rollout_ref.rollout.gpu_memory_utilization=0.6 \
    actor_rollout_ref.rollout.n=5 \
    actor_rollout_ref.ref.fsdp_config.param_offload=True \
    algorithm.use_kl_in_reward=False \
    trainer.critic_warmup=0 \
    trainer.logger=['console','wandb'] \
    trainer.project_name='verl_grpo_example_gsm8k' \
    trainer.experiment_name='qwen2_7b_function_rm_kl1e-3' \
    trainer.val_before_train=False \
    trainer.n_gpus_per_node=8 \
    trainer.nnodes=1 \
    trainer.save_freq=20 \
    trainer.test_freq=5 \
    trainer.total_epochs=15 $@
"""

SCRIPTS = {
    "quickstart": QUICKSTART,
    "run_qwen2-7b": RUN_QWEN2_7B,
    "run_qwen2_5-3b_gsm8k_grpo_lora": RUN_QWEN2_5_3B_LORA,
    "run_qwen2-7b_seq_balance": RUN_QWEN2_7B_SEQ_BALANCE,
}
# what the scripts' shell variables hold when they run (run_qwen2-7b_seq_balance.sh sets the last three)
SHELL = {
    "$HOME": "/home/user",
    "$return_raw_chat": "True",
    "$rollout_name": "sglang",
    "$rollout_mode": "async",
}


def overrides_of(script: str) -> list[str]:
    """The command's key=value words, as the shell would pass them (quotes removed, variables expanded)."""
    for var, value in SHELL.items():
        script = script.replace(var, value)
    words = shlex.split(script.split("verl.trainer.main_ppo", 1)[1].split("2>&1")[0].replace("$@", ""))
    return [w for w in words if "=" in w]


def _field(cfg: Any, dotted: str) -> Any:
    node = cfg
    for part in dotted.split("."):
        node = getattr(node, part)
    return node


def _same(got: Any, want: Any) -> bool:
    if isinstance(got, list) and not isinstance(want, list):
        want = [want]
    if isinstance(got, list):
        return [str(g) for g in got] == [str(w) for w in want]
    if isinstance(got, float | int) and not isinstance(got, bool):
        return float(got) == float(want)
    return str(got) == str(want)


@pytest.mark.parametrize("name", list(SCRIPTS))
def test_every_override_is_mapped_or_warned(name: str) -> None:
    overrides = overrides_of(SCRIPTS[name])
    cfg = load_config(None, overrides)
    warned = "\n".join(inert_key_warnings(cfg))
    for word in overrides:
        key, _, raw = word.partition("=")
        if key in cfg.inert_keys:
            assert key in warned
            continue
        value = yaml.safe_load(raw)
        assert _same(_field(cfg, canonical_key(key)), value), f"{word} -> {canonical_key(key)}"


def test_the_recipes_mean_what_they_meant_in_verl() -> None:
    quick = load_config(None, overrides_of(QUICKSTART))
    warned = "\n".join(inert_key_warnings(quick))
    # verl's default estimator is gae, the quickstart relies on it: its critic keys say so
    assert "algorithm.adv_estimator=gae" in warned
    assert "trainer.total_epochs=15" in warned
    assert quick.actor.ppo_micro_batch_size == 4 and quick.ref.micro_batch_size == 4
    assert quick.data.task == "jsonl" and quick.data.train_files == [
        Path("/home/user/data/gsm8k/train.parquet")
    ]
    lora = load_config(None, overrides_of(RUN_QWEN2_5_3B_LORA))
    assert lora.trainer.logger == ["console", "wandb"] and lora.model.lora_rank == 64
    assert lora.run.id == "qwen2-5_3b_grpo_lora"  # a new experiment is a new run: never another's checkpoint
    seq = load_config(None, overrides_of(RUN_QWEN2_7B_SEQ_BALANCE))
    assert seq.actor.use_dynamic_bsz and seq.actor.ppo_max_token_len_per_gpu == 24000


def test_overrides_counted() -> None:
    distinct = {w for s in SCRIPTS.values() for w in overrides_of(s)}
    assert len(distinct) >= 60, len(distinct)


def test_rlbus_up_names_every_default_that_differs_from_verls() -> None:
    """Through `rlbus up` (rlbus's defaults) the quickstart is told, in one start-up block, which defaults
    differ from verl's and the key that gives verl's; `python -m rlbus.main_ppo` takes verl's (test_main_ppo)."""
    from rlbus.config.verl_defaults import defaults_block, verl_default_overrides

    words = shlex.split(QUICKSTART.split("2>&1")[0].replace("\\\n", " "))[4:]
    cfg = load_config(None, words)
    block = defaults_block(cfg)
    for line in (
        "algorithm.adv_estimator=grpo (verl: gae",
        "rollout.n=8 (verl: 1",
        "rollout.temperature=0.7 (verl: 1.0",
        "trainer.async_level=1 (verl: 0",
    ):
        assert line in block, line
    assert "trainer.total_epochs=" not in block  # the command sets it: no default involved
    verl = load_config(None, [*verl_default_overrides(cfg), *words])
    assert (verl.algorithm.adv_estimator, verl.rollout.n, verl.rollout.temperature) == ("gae", 1, 1.0)
    assert verl.trainer.total_epochs == 15 and defaults_block(verl) == ""
