"""The YAML file of the config load in progress, as pydantic-settings' weakest source (below overrides
and RLBUS_* environment variables). Its own module: the schema names the source, the loader fills it."""

from __future__ import annotations

import contextvars
from typing import Any

from pydantic_settings import PydanticBaseSettingsSource

yaml_layer: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar(
    "rlbus_yaml_layer", default=None
)


class YamlLayerSource(PydanticBaseSettingsSource):
    """The weakest source: the (already alias-mapped) YAML file of the current load."""

    def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:
        return (yaml_layer.get() or {}).get(field_name), field_name, False

    def __call__(self) -> dict[str, Any]:
        return dict(yaml_layer.get() or {})
