"""`rlbus config show --doc`: every key of the resolved config with its value and what it does."""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel


def undocumented_keys(model: type[BaseModel], prefix: str = "") -> list[str]:
    """Dotted keys whose field has no description (the config test keeps this empty)."""
    missing = []
    for name, field in model.model_fields.items():
        if not field.description:
            missing.append(prefix + name)
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            missing += undocumented_keys(field.annotation, f"{prefix}{name}.")
    return missing


def doc_lines(config: BaseModel, prefix: str = "") -> list[str]:
    """`key = value  # description` for every leaf key; a section gets a `# section: description` line."""
    lines = []
    for name, field in type(config).model_fields.items():
        value: Any = getattr(config, name)
        if isinstance(value, BaseModel):
            lines.append(f"# {prefix}{name}: {field.description or ''}")
            lines += doc_lines(value, f"{prefix}{name}.")
            continue
        shown = json.dumps(value if not hasattr(value, "__fspath__") else str(value), default=str)
        lines.append(f"{prefix}{name} = {shown}  # {field.description or ''}")
    return lines
