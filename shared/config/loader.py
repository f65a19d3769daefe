"""Builds an RlbusConfig from a YAML file, dotted overrides and RLBUS_* env vars, with verl spellings."""

from __future__ import annotations

import contextvars
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource

from rlbus.config.schema import RlbusConfig

# verl prefixes -> ours. Longest match wins; keys not listed pass through unchanged.
VERL_PREFIXES: dict[str, str] = {
    "actor_rollout_ref.rollout.response_length": "data.max_response_length",
    "actor_rollout_ref.model.": "model.",
    "actor_rollout_ref.rollout.": "rollout.",
    "actor_rollout_ref.actor.": "actor.",
    "actor_rollout_ref.ref.": "ref.",
    "critic.model.path": "critic.model_path",
    "critic.model.": "critic.",
    "algorithm.kl_ctrl.": "algorithm.kl_ctrl.",
    "actor.kl_loss_type": "actor.kl_loss_type",
}

_yaml_layer: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar("rlbus_yaml_layer", default=None)


class ConfigError(ValueError):
    """A config problem, already phrased for a person: which key, what was wrong, what is allowed."""


class YamlLayerSource(PydanticBaseSettingsSource):
    """The weakest source: the (already alias-mapped) YAML file of the current load."""

    def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:
        return (_yaml_layer.get() or {}).get(field_name), field_name, False

    def __call__(self) -> dict[str, Any]:
        return dict(_yaml_layer.get() or {})


def canonical_key(key: str) -> str:
    """Maps a verl-style dotted key onto ours (e.g. actor_rollout_ref.model.path -> model.path)."""
    for prefix in sorted(VERL_PREFIXES, key=len, reverse=True):
        if key == prefix or (prefix.endswith(".") and key.startswith(prefix)):
            return VERL_PREFIXES[prefix] + key[len(prefix) :] if prefix.endswith(".") else VERL_PREFIXES[prefix]
    return key


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


def _canonical_tree(flat: dict[str, Any]) -> dict[str, Any]:
    return unflatten({canonical_key(k): v for k, v in flat.items()})


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
            lines.append(f"{key}: unknown key (allowed in '{'.'.join(map(str, loc[:-1])) or 'top level'}': "
                         f"{', '.join(allowed)})")
        else:
            lines.append(f"{key}: {item['msg']} (got {item.get('input')!r})")
    return "invalid config:\n  " + "\n  ".join(lines)


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> RlbusConfig:
    """YAML file (weakest), then RLBUS_* env vars, then dotted overrides (strongest)."""
    file_tree: dict[str, Any] = {}
    if path is not None:
        try:
            raw = yaml.safe_load(Path(path).read_text()) or {}
        except (OSError, yaml.YAMLError) as exc:
            raise ConfigError(f"cannot read config file {path}: {exc}") from exc
        if not isinstance(raw, dict):
            raise ConfigError(f"config file {path} must hold a mapping at top level")
        file_tree = _canonical_tree(flatten(raw))
    cli_tree = _canonical_tree(parse_overrides(overrides or []))
    token = _yaml_layer.set(file_tree)
    try:
        return RlbusConfig(**cli_tree)
    except ValidationError as exc:
        raise ConfigError(describe(exc)) from None
    finally:
        _yaml_layer.reset(token)


def dump_config(config: RlbusConfig) -> str:
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)


def save_config(config: RlbusConfig, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(dump_config(config))
    return path


__all__ = [
    "BaseSettings", "ConfigError", "RlbusConfig", "canonical_key", "dump_config", "load_config",
    "parse_overrides", "save_config",
]
