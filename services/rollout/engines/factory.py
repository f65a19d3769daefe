"""Config -> engine. vLLM and SGLang are imported only when chosen, so the default install never needs them."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from rlbus.rollout.engines.base import RolloutEngine

if TYPE_CHECKING:
    from rlbus.config import RlbusConfig


def build_engine(cfg: RlbusConfig, model_path: Path) -> RolloutEngine:
    """Builds the engine `cfg.rollout.name` names, loaded from the checkpoint directory `model_path`."""
    name = cfg.rollout.name
    if name == "hf":
        from rlbus.rollout.engines.hf import HFEngine

        return HFEngine.from_config(cfg, model_path)
    if name == "vllm":
        from rlbus.rollout.engines.vllm_engine import VLLMEngine

        return VLLMEngine.from_config(cfg, model_path)
    if name == "sglang":
        from rlbus.rollout.engines.sglang_engine import SGLangEngine

        return SGLangEngine.from_config(cfg, model_path)
    raise ValueError(f"unknown rollout engine {name!r}; expected 'hf', 'vllm' or 'sglang'")
