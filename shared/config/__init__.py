"""Config: one pydantic model tree, loaded from YAML + RLBUS_* env + dotted overrides."""

from rlbus.config.loader import ConfigError, dump_config, load_config, save_config
from rlbus.config.schema import RlbusConfig

__all__ = ["ConfigError", "RlbusConfig", "dump_config", "load_config", "save_config"]
