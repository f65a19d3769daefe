"""Which decode step a row bucket's static cache runs (`rollout.decode_step`): one choice, made when the engine
is built, of the callables static_decode.py's loop calls per token."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import torch
from transformers import CompileConfig

from rlbus.rollout.engines.static_decode import Sampler

DecodeStepKind = Literal["inductor", "recorded", "recorded_then_inductor"]  # rollout.decode_step


def make_decode_step(
    model: Any, how: DecodeStepKind, device: torch.device, sample: Sampler | None = None
) -> Callable[..., Any]:
    """The decode step a static cache runs: `inductor` compiles it (transformers' `get_compiled_call`: fused
    kernels, in CUDA graphs on a GPU; on the CPU only where tests ask), `recorded` records its eager kernels as
    a CUDA graph per shape (recorded_decode.py: no compile; a GPU only), `recorded_then_inductor` decodes
    recorded while inductor compiles beside it, then records the compiled kernels (recorded_then_compiled.py;
    `sample`, the compiled sampler, compiles beside it too)."""
    if how == "recorded_then_inductor":
        from rlbus.rollout.engines.recorded_then_compiled import RecordedThenCompiled

        return RecordedThenCompiled(model, device, sample)
    if how == "recorded":
        if device.type != "cuda":
            raise ValueError(
                "rollout.decode_step=recorded records CUDA graphs: it needs the replica on a GPU"
            )
        from rlbus.rollout.engines.recorded_decode import RecordedDecodeStep

        return RecordedDecodeStep(model)
    if how != "inductor":
        raise ValueError(f"unknown decode step {how!r}: inductor, recorded or recorded_then_inductor")
    return model.get_compiled_call(decode_compile_config(device))


def decode_compile_config(device: torch.device) -> CompileConfig:
    """transformers' default (CUDA graphs on a GPU) with a static graph per batch shape (sizes as symbols
    compiled 3.2x as long and decoded 10% slower on an H100); on the CPU it compiles only when asked to
    (tests)."""
    config = CompileConfig(dynamic=False)
    if device.type != "cuda":
        setattr(config, "_compile_all_devices", True)  # noqa: B010 (transformers' private test switch)
    return config
