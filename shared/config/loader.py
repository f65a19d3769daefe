"""Builds an RlbusConfig from a YAML file, dotted overrides and RLBUS_* env vars, with verl spellings."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError
from pydantic_settings import BaseSettings

from rlbus.config.quickstart_preference import is_quickstart_preference, quickstart_keys
from rlbus.config.schema import RlbusConfig
from rlbus.config.yaml_layer import yaml_layer

# verl prefixes -> ours. Longest match wins; keys not listed pass through unchanged.
VERL_PREFIXES: dict[str, str] = {
    "actor_rollout_ref.rollout.response_length": "data.max_response_length",
    "actor_rollout_ref.model.": "model.",
    "actor_rollout_ref.rollout.": "rollout.",
    "actor_rollout_ref.actor.": "actor.",
    "actor_rollout_ref.ref.": "ref.",
    "critic.model.path": "critic.model_path",
    "reward_model.model.path": "reward_model.model_path",
    "critic.model.": "critic.",
    "algorithm.kl_ctrl.": "algorithm.kl_ctrl.",
    "actor.kl_loss_type": "actor.kl_loss_type",
}

# verl spellings of our keys, after the prefixes above: exact canonical key -> ours.
VERL_ALIASES: dict[str, str] = {
    "actor.ppo_micro_batch_size_per_gpu": "actor.ppo_micro_batch_size",
    "actor.fsdp_config.param_offload": "actor.param_offload",
    "actor.fsdp_config.optimizer_offload": "actor.optimizer_offload",
    "actor.grad_clip": "actor.optim.grad_clip",
    "actor.policy_loss.loss_mode": "actor.policy_loss",  # verl's current spelling (vanilla, gspo, ...)
    "actor.optim.warmup_style": "actor.optim.lr_scheduler",
    "actor.optim.lr_scheduler_type": "actor.optim.lr_scheduler",
    "critic.grad_clip": "critic.optim.grad_clip",
    "critic.optim.warmup_style": "critic.optim.lr_scheduler",
    "critic.optim.lr_scheduler_type": "critic.optim.lr_scheduler",
    "ref.log_prob_micro_batch_size_per_gpu": "ref.micro_batch_size",
    "ref.log_prob_micro_batch_size": "ref.micro_batch_size",
    "rollout.tensor_parallel_size": "rollout.tensor_model_parallel_size",
    # the deployment guide's rollout micro-batch "that drives inference throughput": prompts a replica
    # generates together (each with its rollout.n samples)
    "rollout.micro_batch_size_per_gpu": "rollout.prompts_per_batch",
    "trainer.max_actor_ckpt_to_keep": "trainer.max_ckpt_to_keep",
    "reward_model.reward_manager": "reward.manager",
    "reward_model.micro_batch_size_per_gpu": "reward_model.micro_batch_size",
}

# verl keys accepted but without effect here (canonical key, or a prefix ending in '.') -> why. They are
# taken out before validation and each becomes a start-up warning naming it (rlbus.config.warnings).
VERL_INERT: dict[str, str] = {
    "rollout.log_prob_micro_batch_size_per_gpu": "log-probs are recomputed with actor.ppo_micro_batch_size",
    "rollout.log_prob_micro_batch_size": "log-probs are recomputed with actor.ppo_micro_batch_size",
    "rollout.log_prob_use_dynamic_bsz": "log-probs are recomputed with the actor's micro-batches",
    "rollout.load_format": "replicas load the checkpoint directory themselves",
    "rollout.layered_summon": "the learner streams full tensors one at a time already",
    "rollout.mode": "rollout replicas are always asynchronous services here",
    "rollout.multi_turn.": "multi-turn rollouts are not supported: generation is single-turn",
    "rollout.dtype": "replicas use model.dtype",
    "rollout.calculate_log_probs": "replicas always record behaviour log-probs",
    "rollout.max_num_batched_tokens": "replicas batch by rollout.max_num_seqs",
    "rollout.enable_chunked_prefill": "left to the engine's default",
    "rollout.free_cache_engine": "replicas are separate processes; they keep their cache",
    "ref.fsdp_config.": "the ref service holds one unsharded copy of the reference model",
    "ref.strategy": "the ref service holds one unsharded copy of the reference model",
    "ref.ulysses_sequence_parallel_size": "no sequence parallelism",
    "actor.strategy": "the learner always uses FSDP2 (one rank: a plain module)",
    "actor.fsdp_config.": "FSDP2 wraps every decoder layer over all learner ranks (wrap_policy, fsdp_size, ...)",
    "actor.ulysses_sequence_parallel_size": "no sequence parallelism",
    "critic.ppo_micro_batch_size_per_gpu": "the critic trains on the actor's micro-batches",
    "critic.ppo_micro_batch_size": "the critic trains on the actor's micro-batches",
    "critic.ppo_mini_batch_size": "the critic trains on the actor's mini-batches",
    "critic.fsdp_config.": "the critic is sharded like the policy",
    "critic.use_remove_padding": "the critic shares the policy's model settings",
    "critic.enable_gradient_checkpointing": "the critic shares the policy's model settings",
    "critic.strategy": "the critic is sharded like the policy",
    "critic.ulysses_sequence_parallel_size": "no sequence parallelism",
    "model.external_lib": "no external model library is imported",
    "data.return_raw_chat": "chat prompts are always rendered by the learner with the tokenizer's template",
    "data.num_workers": "data is read once at start; no loader workers",
    "data.dataloader_num_workers": "data is read once at start; no loader workers",
    "trainer.default_hdfs_dir": "no HDFS upload: checkpoints stay in trainer.default_local_dir",
    "trainer.log_val_generations": "validation generations are not logged",
    "trainer.val_generations_to_log_to_wandb": "validation generations are not logged",
    "trainer.use_legacy_worker_impl": "one worker implementation",
    "trainer.balance_batch": "batches are split by tokens when packing (model.use_remove_padding)",
    "reward_model.model.input_tokenizer": "the reward model reads the prompt and response as text with its own tokenizer",
    "reward_model.model.external_lib": "no external model library is imported",
    "reward_model.model.trust_remote_code": "the reward model loads with model.trust_remote_code",
    "reward_model.model.fsdp_config.": "the reward model is one unsharded copy in the reward service",
    "reward_model.strategy": "the reward model is one unsharded copy in the reward service",
    "reward_model.use_dynamic_bsz": "the reward model batches reward_model.micro_batch_size responses",
    "reward_model.forward_max_token_len_per_gpu": "the reward model batches reward_model.micro_batch_size responses",
    "reward_model.ulysses_sequence_parallel_size": "no sequence parallelism",
    "reward_model.launch_reward_fn_async": "the reward service always scores beside generation",
}


class ConfigError(ValueError):
    """A config problem, already phrased for a person: which key, what was wrong, what is allowed."""


def canonical_key(key: str) -> str:
    """Maps a verl-style dotted key onto ours (e.g. actor_rollout_ref.model.path -> model.path)."""
    for prefix in sorted(VERL_PREFIXES, key=len, reverse=True):
        if key == prefix or (prefix.endswith(".") and key.startswith(prefix)):
            key = (
                VERL_PREFIXES[prefix] + key[len(prefix) :] if prefix.endswith(".") else VERL_PREFIXES[prefix]
            )
            break
    return VERL_ALIASES.get(key, key)


def inert_reason(key: str) -> str | None:
    """Why a canonical key has no effect here, or None when it is one of ours."""
    if key in VERL_INERT:
        return VERL_INERT[key]
    for prefix, reason in VERL_INERT.items():
        if prefix.endswith(".") and key.startswith(prefix):
            return reason
    return None


def _split_inert(flat: dict[str, Any], inert: dict[str, str]) -> dict[str, Any]:
    kept = {}
    for key, value in flat.items():
        canonical = canonical_key(key)
        reason = inert_reason(canonical)
        if reason is None:
            kept[canonical] = value
        else:
            inert[key] = reason
    return kept


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(flatten(value, dotted + "."))
        else:
            flat[dotted] = value
    return flat


def unflatten(flat: dict[str, Any]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for dotted, value in flat.items():
        node = tree
        parts = dotted.split(".")
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"{dotted}: '{part}' is a value, not a section")
            node = child
        node[parts[-1]] = value
    return tree


def parse_overrides(args: list[str]) -> dict[str, Any]:
    """`a.b=3 c.d=[x,y]` -> {"a.b": 3, "c.d": ["x", "y"]}; values are read as YAML scalars/lists."""
    flat: dict[str, Any] = {}
    for arg in args:
        key, sep, raw = arg.partition("=")
        if not sep or not key:
            raise ConfigError(f"override '{arg}' must look like section.key=value")
        key = key.lstrip("+")
        try:
            flat[key] = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError:
            flat[key] = raw
    return flat


def _canonical_tree(flat: dict[str, Any], inert: dict[str, str]) -> dict[str, Any]:
    """verl spellings mapped onto ours; keys without effect here go into `inert` instead."""
    return unflatten(_split_inert(flat, inert))


def _allowed_keys(loc: tuple[Any, ...]) -> list[str]:
    model: type[BaseModel] | None = RlbusConfig
    for part in loc:
        if model is None:
            return []
        field = model.model_fields.get(str(part))
        annotation = field.annotation if field else None
        model = annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None
    return sorted(model.model_fields) if model is not None else []


def describe(error: ValidationError) -> str:
    """One line per problem, naming the dotted key and what is allowed."""
    lines = []
    for item in error.errors():
        loc = tuple(item["loc"])
        key = ".".join(str(p) for p in loc) or "<root>"
        if item["type"] == "extra_forbidden":
            allowed = _allowed_keys(loc[:-1])
            lines.append(
                f"{key}: unknown key (allowed in '{'.'.join(map(str, loc[:-1])) or 'top level'}': "
                f"{', '.join(allowed)})"
            )
        else:
            lines.append(f"{key}: {item['msg']} (got {item.get('input')!r})")
    return "invalid config:\n  " + "\n  ".join(lines)


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> RlbusConfig:
    """YAML file (weakest), then RLBUS_* env vars, then dotted overrides (strongest)."""
    file_tree: dict[str, Any] = {}
    inert: dict[str, str] = {}
    if path is not None:
        try:
            raw = yaml.safe_load(Path(path).read_text()) or {}
        except (OSError, yaml.YAMLError) as exc:
            raise ConfigError(f"cannot read config file {path}: {exc}") from exc
        if not isinstance(raw, dict):
            raise ConfigError(f"config file {path} must hold a mapping at top level")
        flat = flatten(raw)
        if is_quickstart_preference(raw):  # the users' quick start's DPO YAML: its keys onto ours
            try:
                flat, quickstart_inert = quickstart_keys(flat)
            except ValueError as exc:
                raise ConfigError(f"config file {path}: {exc}") from None
            inert.update(quickstart_inert)
        file_tree = _canonical_tree(flat, inert)
    cli_tree = _canonical_tree(parse_overrides(overrides or []), inert)
    token = yaml_layer.set(file_tree)
    try:
        config = RlbusConfig(**cli_tree)
        config.inert_keys.update(inert)
        return config
    except ValidationError as exc:
        raise ConfigError(describe(exc)) from None
    finally:
        yaml_layer.reset(token)


def dump_config(config: RlbusConfig) -> str:
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)


def save_config(config: RlbusConfig, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(dump_config(config))
    return path


__all__ = [
    "BaseSettings",
    "ConfigError",
    "RlbusConfig",
    "canonical_key",
    "dump_config",
    "load_config",
    "parse_overrides",
    "save_config",
]
