"""The policy model at scale: load, Liger, LoRA, FSDP2 sharding, and full weights streamed one tensor at a time."""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from rlbus.logs import get_logger
from rlbus.modeling import compile_pays, parameter_count

if TYPE_CHECKING:
    from rlbus.config import RlbusConfig
from rlbus.learner.dist.context import DistContext
from rlbus.learner.varlen_attention import packed_attention

log = get_logger("rlbus.learner.model")


def compiles_layers(cfg: RlbusConfig, device: torch.device, parameters: int) -> bool:
    """Whether the policy's decoder layers are torch.compiled: as asked, else on a GPU for a model large
    enough to win the compile back (`compile_pays`) and without Liger (Liger's kernels are the fusion already,
    and its RMSNorm kernel fails to build inside an inductor graph: torch 2.11, liger 0.8.5, where dynamo then
    retraces and warns on every block)."""
    if cfg.actor.use_torch_compile is not None:
        return cfg.actor.use_torch_compile
    return device.type == "cuda" and not cfg.model.use_liger and compile_pays(parameters)


def build_policy_model(cfg: RlbusConfig, model_path: Path | str, ctx: DistContext) -> nn.Module:
    """Load, then (as configured) gradient checkpointing, LoRA, FSDP2 per decoder layer and root.

    FSDP2 with more than one rank, or with offload (``RLBUS_FSDP=1`` forces it on one GPU). On a GPU with
    ``model.dtype`` bf16/fp16 the weights load in fp32 (the optimizer's master copy) and
    ``MixedPrecisionPolicy(param_dtype=model.dtype, reduce_dtype=fp32)`` computes in the low precision; a
    single GPU without offload gets the same numerics from ``torch.autocast`` on the plain module (FSDP's
    per-layer hooks only cost there: on an H200, Qwen2-0.5B-sized, steps took 1.19x as long at 4 x 2048-token
    micro-batches and 1.47x at 4 x 1024; see bench/learner.py).
    Otherwise the weights load in ``model.dtype``. ``actor.param_offload`` (or ``optimizer_offload``:
    FSDP2 offloads parameters, gradients and the optimizer step together) keeps the shards on the CPU
    (``CPUOffloadPolicy``).
    """
    from rlbus.modeling import load_causal_lm, torch_dtype

    mcfg = cfg.model
    offload = cfg.actor.param_offload or cfg.actor.optimizer_offload
    fsdp = ctx.initialized and (ctx.world_size > 1 or offload or os.environ.get("RLBUS_FSDP") == "1")
    mode = cfg.actor.master_weights
    master_in_optimizer = mcfg.dtype != "float32" and (mode == "optimizer" or (mode == "auto" and not fsdp))
    if master_in_optimizer and fsdp:
        raise RuntimeError(
            "actor.master_weights=optimizer needs one learner rank without offload; under FSDP2 "
            "the fp32 master weights are the sharded parameters (actor.master_weights=model)"
        )
    mixed = (
        ctx.initialized and ctx.device.type == "cuda" and mcfg.dtype != "float32" and not master_in_optimizer
    )
    attn = packed_attention(ctx.device, torch_dtype(mcfg.dtype)) if mcfg.use_remove_padding else "sdpa"
    model: nn.Module = load_causal_lm(
        model_path,
        "float32" if mixed else mcfg.dtype,
        "cpu" if fsdp else ctx.device,
        trainable=True,
        attn_implementation=attn,
        trust_remote_code=mcfg.trust_remote_code,
    )
    if mcfg.use_liger:
        apply_liger(model)
    model._rlbus_compiled_layers = compiles_layers(cfg, ctx.device, parameter_count(model))  # type: ignore[assignment]  # a flag, read by the trainer
    if model._rlbus_compiled_layers:
        # Every block shares one code object, so its graphs (grad on/off, packed or padded) count against
        # one recompile limit: past torch's default of 8, dynamo silently runs the block eager.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        # Dynamic from the start: one graph for every width (with torch's default, the second width
        # recompiles the blocks dynamic). The trainer's warm-up compiles them before step 1.
        log.info("the decoder layers are compiled, with dynamic shapes")
        for layer in decoder_layers(model):  # one compiled graph, reused by every (identical) block
            layer.compile(dynamic=True)
    if mcfg.enable_gradient_checkpointing:
        # non-reentrant: works with frozen inputs (LoRA) and with FSDP2's hooks
        cast(Any, model).gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if mcfg.lora_rank > 0:
        model = apply_lora(model, mcfg.lora_rank, mcfg.lora_alpha, mcfg.target_modules, cfg.trainer.seed)
    if fsdp:
        shard_model(model, ctx, torch_dtype(mcfg.dtype) if mixed else None, offload=offload)
    elif mixed:  # one GPU: the same numerics without FSDP's per-layer hooks (fp32 master, bf16 compute)
        model._rlbus_autocast = torch_dtype(mcfg.dtype)  # type: ignore[assignment]  # a flag, not a submodule
    model._rlbus_master_in_optimizer = master_in_optimizer  # type: ignore[assignment]  # read by optim.build_optimizer
    return model


def apply_liger(model: nn.Module) -> None:
    """Liger's fused RMSNorm, SwiGLU and RoPE kernels in place (its fused losses stay off: the log-probs come
    from rlbus.chunked_logprobs). A model type Liger does not know is left as it is, with a warning."""
    try:
        from liger_kernel.transformers.monkey_patch import (
            MODEL_TYPE_TO_APPLY_LIGER_FN,
            _apply_liger_kernel_to_instance,
        )
    except ImportError as exc:
        raise RuntimeError(f"model.use_liger=true needs the liger-kernel package: {exc}") from exc
    model_type = getattr(model.config, "model_type", None)
    if model_type not in MODEL_TYPE_TO_APPLY_LIGER_FN:
        log.warning(
            "model.use_liger: Liger has no kernels for this model type; left unchanged", model_type=model_type
        )
        return
    _apply_liger_kernel_to_instance(
        model, rope=True, rms_norm=True, swiglu=True, cross_entropy=False, fused_linear_cross_entropy=False
    )


def apply_lora(
    model: nn.Module, rank: int, alpha: int, target_modules: list[str] | str, seed: int
) -> nn.Module:
    """peft LoRA adapters; only they stay trainable. Initialised from ``seed`` so every rank agrees."""
    from peft import LoraConfig, get_peft_model

    lcfg = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        target_modules=target_modules,
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return get_peft_model(model, lcfg)


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks (``_no_split_modules`` of the HF model): one FSDP unit each."""
    base = cast(Any, model).get_base_model() if hasattr(model, "get_base_model") else model
    names = set(getattr(base, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        for name, m in model.named_modules():
            if name.endswith("layers") and isinstance(m, nn.ModuleList):
                return list(m)
    return layers


def shard_model(
    model: nn.Module, ctx: DistContext, param_dtype: torch.dtype | None, offload: bool
) -> nn.Module:
    """``fully_shard`` each decoder layer, then the root (embeddings, final norm, a tied lm_head)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
    kwargs: dict[str, Any] = {
        "mesh": mesh,
        "mp_policy": MixedPrecisionPolicy(
            param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype is not None else None
        ),
        "offload_policy": CPUOffloadPolicy(pin_memory=ctx.device.type == "cuda")
        if offload
        else OffloadPolicy(),
    }
    for layer in decoder_layers(model):
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    return model


def is_lora(model: nn.Module) -> bool:
    return hasattr(model, "peft_config")


# ------------------------------------------------------------------------------------------ full weights


def _full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor on every rank: a DTensor is all-gathered, anything else is returned as is."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        mesh_type = t.device_mesh.device_type
        local = t.to_local()
        if local.device.type != mesh_type:  # CPU-offloaded shard: gather on the mesh's device
            t = DTensor.from_local(
                local.to(mesh_type), t.device_mesh, t.placements, shape=t.shape, stride=t.stride()
            )
        return t.full_tensor()
    return t.detach()


def _cast(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    return t.to(dtype) if dtype is not None and t.is_floating_point() and t.dtype != dtype else t


def _lora_delta(model: nn.Module, module_path: str) -> torch.Tensor | None:
    """``scale * B @ A`` (in the base weight's layout) of the LoRA layer at ``module_path``, gathered."""
    from peft.tuners.lora import LoraLayer

    module = model.get_submodule(module_path)
    if not isinstance(module, LoraLayer):
        return None
    deltas = []
    for adapter in module.active_adapters:
        if adapter not in module.lora_A:
            if adapter in getattr(module, "lora_embedding_A", {}):
                raise NotImplementedError(
                    "LoRA on embeddings: leave embed_tokens out of model.target_modules"
                )
            continue
        lora: Any = module
        a = _full(lora.lora_A[adapter].weight).float()
        b = _full(lora.lora_B[adapter].weight).float()
        if a.dim() != 2:
            raise NotImplementedError(f"LoRA merge of {type(module).__name__} at {module_path}")
        delta = (b @ a) * module.scaling[adapter]
        deltas.append(delta.T if getattr(module, "fan_in_fan_out", False) else delta)
    return sum(deltas) if deltas else None


def full_state_items(
    model: nn.Module, dtype: torch.dtype | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, full tensor)`` in ``state_dict`` order, one at a time (then freed by the consumer).

    Under FSDP2 every rank must iterate this to the end together (each item is an all-gather); every rank
    gets the full tensor, which non-leader ranks drop at once. ``dtype`` casts floating tensors (the
    push sends ``model.dtype`` even when the master weights are fp32). A LoRA model yields the merged
    weights under the base model's names and no adapter tensors.
    """
    lora = is_lora(model)
    for name, t in model.state_dict().items():
        if lora and any(p.startswith("lora_") for p in name.split(".")):
            continue
        out_name = name.removeprefix("base_model.model.").replace(".base_layer.", ".") if lora else name
        yield out_name, _full_item(model, name, t, lora, dtype)  # computed outside grad mode, yielded here


@torch.no_grad()
def _full_item(
    model: nn.Module, name: str, t: torch.Tensor, lora: bool, dtype: torch.dtype | None
) -> torch.Tensor:
    full = _full(t)
    if lora and name.endswith(".base_layer.weight"):
        delta = _lora_delta(model, name.removesuffix(".base_layer.weight"))
        if delta is not None:
            full = (full.float() + delta.to(full.device)).to(full.dtype)
    return _cast(full, dtype)


def clip_grad_norm(parameters: Iterable[nn.Parameter], max_norm: float) -> torch.Tensor:
    """``clip_grad_norm_`` that returns the GLOBAL norm as a plain tensor (DTensor grads under FSDP2)."""
    from torch.distributed.tensor import DTensor

    norm = torch.nn.utils.clip_grad_norm_(list(parameters), max_norm)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    return norm
