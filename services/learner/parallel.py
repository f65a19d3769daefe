"""The learner at scale: torch.distributed set-up, FSDP2, LoRA, streamed full weights, rank-0-led steps, packing.

Process layout (``torchrun --nproc-per-node N -m rlbus.learner.main --config FILE``; one CPU process is
the degenerate case and runs none of the distributed code):

* **rank 0** runs the asyncio learner service (bus, dispatch, rollout replicas, the weight push). Each
  time it needs the other ranks it *leads* one operation over the default process group:

  ============  =====================================  ==============================================
  op            payload                                 sent by
  ============  =====================================  ==============================================
  ``INIT``      ``{model_path, total_steps}``           ``PolicyTrainer.__init__`` (workers build theirs)
  ``TRAIN``     the collated ``TrainBatch``             ``PolicyTrainer.train_step``
  ``GATHER``    none                                    the first ``next()`` of ``named_weights()``
  ``CALL``      ``{name, kwargs}`` (JSON)               ``DistContext.lead_call``: service.py leads
                                                        ``save_checkpoint``, ``load_checkpoint``, ``save_hf``
  ``STOP``      none                                    ``run_learner`` when the service returns
  ============  =====================================  ==============================================

* **rank k > 0** runs :func:`rlbus.learner.worker.worker_main`: ``receive op -> run it`` until ``STOP``.
  It never touches NATS or a replica; it trains on its share of every batch and takes part in every
  all-gather of the weights.

An op is an int64 header broadcast from rank 0 on the CPU (gloo) side of the default group, then its
payload (JSON bytes, then the batch tensors, all on the CPU side: a batch is token ids, a few MB). On GPU
the default group is ``cpu:gloo,cuda:nccl``: workers idle in a gloo broadcast between steps (no NCCL
watchdog fires while rank 0 waits minutes for rollouts) and FSDP's collectives run on NCCL.

Data parallelism: every rank receives the whole batch, computes the advantages of the whole batch (GRPO
groups never straddle ranks), then trains on its share of each mini-batch (sequences dealt longest first
to the least-loaded rank). Losses are normalised by the mini-batch's GLOBAL token (or sequence) count
divided by the world size, and FSDP averages gradients over ranks, so N ranks compute exactly the
gradient one process computes on the same batch. Every rank must run the same number of forward and
backward passes (each one is a collective): the micro-batch count is all-reduced (max) and a rank with
fewer splits its largest micro-batch or, with nothing left, runs a masked dummy (zero loss, zero grad).

Weights: :func:`full_state_items` yields ``(name, full tensor)`` one parameter at a time (a DTensor's
``full_tensor()``), so a push never holds more than one unsharded parameter (plus the sender's bucket).
With LoRA it yields the MERGED weights under the base model's names (``W + scale * B @ A``), so every
rollout engine loads them as a plain state dict and never needs to know about adapters.
"""

from __future__ import annotations

import inspect
import json
import math
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, fields
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from rlbus.logs import get_logger

if TYPE_CHECKING:
    from rlbus.config import RlbusConfig
    from rlbus.learner.batch import TrainBatch

OP_INIT, OP_TRAIN, OP_GATHER, OP_CALL, OP_STOP = 1, 2, 3, 4, 5
OP_NAMES = {OP_INIT: "INIT", OP_TRAIN: "TRAIN", OP_GATHER: "GATHER", OP_CALL: "CALL", OP_STOP: "STOP"}
_MAGIC = 0x524C4255_534C4541  # "RLBUSLEA"
DEFAULT_TIMEOUT_S = 3600.0

WORKER_OPS: dict[str, Callable[..., Any]] = {}
log = get_logger("rlbus.learner.parallel")


def register_worker_op(name: str, fn: Callable[..., Any]) -> None:
    """Make ``fn(trainer, **kwargs)`` runnable on the worker ranks by ``DistContext.lead_call(name, ...)``.

    For work that is a collective under FSDP (a sharded checkpoint save/load with
    ``torch.distributed.checkpoint``): rank 0 calls ``lead_call`` and then does its own part; every worker
    runs ``fn`` with the same kwargs at the same point of the op sequence.
    """
    WORKER_OPS[name] = fn


# ------------------------------------------------------------------------------------------ process group


@dataclass
class DistContext:
    """Who this process is. ``initialized`` means a default process group exists and FSDP2 is used."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    initialized: bool = False
    _active_gather: _LedGather | None = field(default=None, repr=False)
    mid_op: bool = field(default=False, repr=False)  # rank 0 is inside a led op (collectives under way)

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.initialized and self.world_size > 1

    @property
    def leads_workers(self) -> bool:
        return self.distributed and self.rank == 0

    # -------------------------------------------------------------------------------------- wire

    def _send_op(self, op: int, payload: dict | None = None) -> None:
        data = json.dumps(payload).encode() if payload is not None else b""
        header = torch.tensor([_MAGIC, op, len(data), 0], dtype=torch.int64)
        dist.broadcast(header, src=0)
        if data:
            dist.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8), src=0)

    def _recv_op(self) -> tuple[int, dict | None]:
        header = torch.zeros(4, dtype=torch.int64)
        dist.broadcast(header, src=0)
        magic, op, nbytes, _ = (int(x) for x in header.tolist())
        if magic != _MAGIC or op not in OP_NAMES:
            raise RuntimeError(
                f"rank {self.rank}: bad op header {header.tolist()}: the ranks are out of step"
            )
        payload = None
        if nbytes:
            buf = torch.empty(nbytes, dtype=torch.uint8)
            dist.broadcast(buf, src=0)
            payload = json.loads(bytes(buf.numpy()))
        return op, payload

    def _finish_gather(self) -> None:
        gen, self._active_gather = self._active_gather, None
        if gen is not None:
            gen.close()  # a started gather drains; a never-started one sent nothing

    # ---------------------------------------------------------------------------------- leader side

    def lead_init(self, model_path: Path | str, total_steps: int) -> None:
        """Rank 0 builds its trainer: the workers build theirs from the same checkpoint and schedule."""
        if self.leads_workers:
            self._finish_gather()
            self._send_op(OP_INIT, {"model_path": str(model_path), "total_steps": int(total_steps)})

    def lead_train(self, batch: TrainBatch) -> TrainBatch:
        """Rank 0: send the batch to every worker (they then run the same train_step). Identity elsewhere."""
        if not self.leads_workers:
            return batch
        self._finish_gather()
        self.mid_op = True
        tensors, meta = _batch_parts(batch)
        self._send_op(OP_TRAIN, meta)
        for t in tensors:
            dist.broadcast(t, src=0)
        return batch

    def end_op(self) -> None:
        self.mid_op = False

    def lead_gather(self, make_items: Callable[[], Iterable[tuple[str, torch.Tensor]]]) -> Iterator:
        """Rank 0 of several: a lazy stream that tells the workers to gather alongside once it starts.

        Creating it sends nothing (a push that fails before sending never desyncs anyone). A stream left
        unfinished (the sender gave up mid-push) is drained by the next led op, so the ranks stay in step.
        """
        if not self.leads_workers:
            return iter(make_items())
        return _LedGather(self, make_items)

    def lead_call(self, name: str, **kwargs: Any) -> None:
        """Rank 0: run the registered worker op ``name`` on every worker (then do rank 0's own part)."""
        if self.leads_workers:
            self._finish_gather()
            self._send_op(OP_CALL, {"name": name, "kwargs": kwargs})

    def stop_workers(self) -> None:
        """Rank 0: end every worker's loop. Skipped when a led op broke off halfway (the ranks are out of
        step and a header would be read as that op's data): torchrun then tears the group down."""
        if self.leads_workers:
            self._finish_gather()
            if not self.mid_op:
                self._send_op(OP_STOP)
                self.exit_together()

    def exit_together(self) -> None:
        """Every rank waits here before tearing its group down: a rank that destroys gloo's pairs while a
        peer still uses them can abort the peer's process at exit ('terminate called without an active
        exception'), which torchrun reports as a failed job."""
        self.all_reduce(torch.zeros(1))

    # ---------------------------------------------------------------------------------- collectives

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """In place on every rank (identity without a group). ``op``: sum, max, avg (via sum / world)."""
        if not self.distributed:
            return tensor
        if op == "max":
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        else:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
            if op == "avg":
                tensor /= self.world_size
        return tensor

    def max_int(self, value: int) -> int:
        if not self.distributed:
            return int(value)
        return int(self.all_reduce(torch.tensor([int(value)], dtype=torch.int64), "max").item())


class _LedGather:
    """Iterator of ``(name, full tensor)`` on rank 0 whose first ``next()`` starts the workers' gather."""

    def __init__(
        self, ctx: DistContext, make_items: Callable[[], Iterable[tuple[str, torch.Tensor]]]
    ) -> None:
        self.ctx = ctx
        self.make_items = make_items
        self.items: Iterator | None = None
        self.done = False

    def __iter__(self) -> _LedGather:
        return self

    def __next__(self) -> tuple[str, torch.Tensor]:
        if self.done:
            raise StopIteration
        ctx = self.ctx
        if self.items is None:
            ctx._finish_gather()
            ctx.mid_op = True
            ctx._send_op(OP_GATHER)
            ctx._active_gather = self
            self.items = iter(self.make_items())
        try:
            return next(self.items)
        except StopIteration:
            self._end()
            raise
        except BaseException:
            self.done = True  # a collective failed: the ranks are out of step, mid_op stays set
            raise

    def close(self) -> None:
        """Finish the gather without handing anything out (every rank iterates to the end together)."""
        if self.items is not None and not self.done:
            for _ in self.items:
                pass
            self._end()

    def _end(self) -> None:
        self.done = True
        self.ctx.mid_op = False
        if self.ctx._active_gather is self:
            self.ctx._active_gather = None


_CTX: DistContext | None = None


def _env_int(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        return default


def init_distributed(device_pref: str = "auto", timeout_s: float = DEFAULT_TIMEOUT_S) -> DistContext:
    """Set up this process from torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT).

    WORLD_SIZE > 1: ``init_process_group`` (``gloo`` on CPU, ``cpu:gloo,cuda:nccl`` on GPU) with device
    ``cuda:LOCAL_RANK``. One process on a GPU: a world of one (FSDP2 still gives mixed precision with fp32
    master weights and CPU offload). One process on the CPU: no group at all, the plain module.
    Idempotent: later calls return the same context.
    """
    global _CTX
    if _CTX is not None:
        return _CTX
    world = _env_int("WORLD_SIZE", 1)
    rank = _env_int("RANK", 0)
    local_rank = _env_int("LOCAL_RANK", 0)
    use_cuda = torch.cuda.is_available() and device_pref in ("auto", "cuda")
    if use_cuda:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    timeout = timedelta(seconds=timeout_s)
    if dist.is_initialized():
        _CTX = DistContext(dist.get_rank(), dist.get_world_size(), local_rank, device, True)
    elif world > 1:
        dist.init_process_group("cpu:gloo,cuda:nccl" if use_cuda else "gloo", timeout=timeout)
        _CTX = DistContext(rank, world, local_rank, device, True)
    elif use_cuda:
        dist.init_process_group(
            "cpu:gloo,cuda:nccl", store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
        )
        _CTX = DistContext(0, 1, local_rank, device, True)
    else:
        _CTX = DistContext(0, 1, 0, device, False)
    return _CTX


def context(device: torch.device | str | None = None) -> DistContext:
    """The process's context: the one ``init_distributed`` made, else the one a bare trainer needs.

    A trainer built without ``init_distributed`` (tests, notebooks) on a CUDA device or under torchrun
    initialises here; on the CPU it stays a plain single process on ``device``.
    """
    if _CTX is not None:
        return _CTX
    dev = torch.device(device) if device is not None else torch.device("cpu")
    if dist.is_initialized() or _env_int("WORLD_SIZE", 1) > 1 or dev.type == "cuda":
        return init_distributed("cuda" if dev.type == "cuda" else "cpu")
    return DistContext(device=dev)


def shutdown() -> None:
    """Destroy the default group this module made (no-op otherwise)."""
    global _CTX
    ctx, _CTX = _CTX, None
    if ctx is not None and ctx.initialized and dist.is_initialized():
        dist.destroy_process_group()


# ------------------------------------------------------------------------------------------ batches


def _batch_parts(batch: TrainBatch) -> tuple[list[torch.Tensor], dict]:
    """The batch's tensors (CPU, contiguous) and a JSON description: any TrainBatch field travels."""
    tensors, described, values = [], [], {}
    for f in fields(batch):
        v = getattr(batch, f.name)
        if isinstance(v, torch.Tensor):
            t = v.detach().to("cpu").contiguous()
            tensors.append(t)
            described.append([f.name, str(t.dtype).removeprefix("torch."), list(t.shape)])
        else:
            values[f.name] = v
    return tensors, {"tensors": described, "values": values}


# ------------------------------------------------------------------------------------------ the model


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
    model = load_causal_lm(
        model_path,
        "float32" if mixed else mcfg.dtype,
        "cpu" if fsdp else ctx.device,
        trainable=True,
        attn_implementation=attn,
        trust_remote_code=mcfg.trust_remote_code,
    )
    if mcfg.use_liger:
        apply_liger(model)
    compile_layers = cfg.actor.use_torch_compile
    if compile_layers is None:
        compile_layers = ctx.device.type == "cuda"
    if compile_layers:
        # Every block shares one code object, so its graphs (grad on/off, each width until dynamic
        # shapes kick in, packed or padded) count against one recompile limit: past torch's default
        # of 8, dynamo silently runs the block eager.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        for layer in decoder_layers(model):  # one compiled graph, reused by every (identical) block
            layer.compile()
    if mcfg.enable_gradient_checkpointing:
        # non-reentrant: works with frozen inputs (LoRA) and with FSDP2's hooks
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if mcfg.lora_rank > 0:
        model = apply_lora(model, mcfg.lora_rank, mcfg.lora_alpha, mcfg.target_modules, cfg.trainer.seed)
    if fsdp:
        shard_model(model, ctx, torch_dtype(mcfg.dtype) if mixed else None, offload=offload)
    elif mixed:  # one GPU: the same numerics without FSDP's per-layer hooks (fp32 master, bf16 compute)
        model._rlbus_autocast = torch_dtype(mcfg.dtype)
    model._rlbus_master_in_optimizer = master_in_optimizer  # rlbus.learner.optim.build_optimizer reads it
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
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
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
        a = _full(module.lora_A[adapter].weight).float()
        b = _full(module.lora_B[adapter].weight).float()
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


# ------------------------------------------------------------------------------------------ micro-batches


def split_for_ranks(positions: Iterable[int], lengths: list[int], world: int) -> list[list[int]]:
    """Longest sequence first onto the least-loaded rank (tokens, then count); each list kept in order."""
    shares: list[list[int]] = [[] for _ in range(world)]
    if world == 1:
        return [list(positions)]
    load = [(0, 0)] * world
    for i in sorted(positions, key=lambda j: (-lengths[j], j)):
        r = min(range(world), key=lambda k: (load[k], k))
        shares[r].append(i)
        load[r] = (load[r][0] + lengths[i], load[r][1] + 1)
    return [sorted(s) for s in shares]


def token_bins(positions: list[int], lengths: list[int], max_tokens: int) -> list[list[int]]:
    """First-fit decreasing: micro-batches of at most ``max_tokens`` real tokens (a longer one goes alone)."""
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in sorted(positions, key=lambda j: (-lengths[j], j)):
        for k, load in enumerate(loads):
            if load + lengths[i] <= max_tokens:
                bins[k].append(i)
                loads[k] += lengths[i]
                break
        else:
            bins.append([i])
            loads.append(lengths[i])
    return bins


def equalize(bins: list[list[int]], target: int, lengths: list[int]) -> list[list[int]]:
    """``target`` micro-batches: split the heaviest splittable one in two; ``[]`` (a dummy) when none is."""
    bins = [list(b) for b in bins]
    while len(bins) < target:
        splittable = [k for k, b in enumerate(bins) if len(b) > 1]
        if not splittable:
            bins.append([])
            continue
        k = max(splittable, key=lambda j: sum(lengths[i] for i in bins[j]))
        b = sorted(bins.pop(k), key=lambda i: (-lengths[i], i))
        left, right, lt, rt = [], [], 0, 0
        for i in b:  # greedy halves by tokens
            if lt <= rt:
                left.append(i)
                lt += lengths[i]
            else:
                right.append(i)
                rt += lengths[i]
        bins[k:k] = [sorted(left), sorted(right)]
    return bins


@dataclass
class MicroBatch:
    """Rows ``idx`` of the batch as the sub-batch ``batch``; unpacks as ``idx, batch``. A ``dummy`` (see
    plan_micro_batches) has one real row whose response mask is zero: it only keeps the ranks in step."""

    idx: list[int]
    batch: TrainBatch
    dummy: bool = False

    def __iter__(self) -> Iterator:
        return iter((self.idx, self.batch))


def plan_micro_batches(
    batch: TrainBatch,
    ctx: DistContext,
    micro_batch_size: int,
    packed: bool,
    max_tokens: int,
    positions: Iterable[int] | None = None,
) -> list[MicroBatch]:
    """This rank's micro-batches of ``batch`` (or of its ``positions``), in the order to run them.

    Padded: ``micro_batch_size`` sequences each. Packed (``model.use_remove_padding``): token-bounded by
    ``max_tokens`` (``actor.ppo_max_token_len_per_gpu``). Under data parallelism each rank takes its share
    first, and all ranks end with the same number of micro-batches (see the module docstring): a dummy
    is a real sequence with its response mask zeroed, so it adds nothing to the loss or the gradient.
    """
    lengths = [int(x) for x in batch.attention_mask.sum(-1).tolist()]
    pos = list(range(batch.size)) if positions is None else list(positions)
    mine = split_for_ranks(pos, lengths, ctx.world_size)[ctx.rank] if ctx.distributed else pos
    if packed:
        bins = token_bins(mine, lengths, max_tokens)
    else:
        bins = [mine[i : i + micro_batch_size] for i in range(0, len(mine), micro_batch_size)]
    if ctx.distributed:
        bins = equalize(bins, ctx.max_int(len(bins)), lengths)
    out = []
    for b in bins:
        if b:
            out.append(MicroBatch(b, batch.select(b)))
            continue
        j = min(pos or range(batch.size), key=lambda i: (lengths[i], i))
        dummy = batch.select([j])
        dummy.response_mask = torch.zeros_like(dummy.response_mask)
        out.append(MicroBatch([j], dummy, dummy=True))
    return out


def reduce_stats(ctx: DistContext, mean_sums: dict[str, float], *sum_dicts: dict[str, float]) -> None:
    """In place, on every rank: ``mean_sums`` averaged over ranks, each of ``sum_dicts`` summed."""
    if not ctx.distributed:
        return
    dicts = [mean_sums, *sum_dicts]
    keys = [sorted(d) for d in dicts]
    flat = torch.tensor([d[k] for d, ks in zip(dicts, keys, strict=True) for k in ks], dtype=torch.float64)
    width = torch.tensor([flat.numel(), -flat.numel()], dtype=torch.int64)
    ctx.all_reduce(width, "max")
    if int(width[0]) != -int(width[1]):
        raise RuntimeError("ranks report different metric keys: their train steps diverged")
    ctx.all_reduce(flat, "sum")
    i = 0
    for n, (d, ks) in enumerate(zip(dicts, keys, strict=True)):
        for k in ks:
            d[k] = float(flat[i]) / (ctx.world_size if n == 0 else 1)
            i += 1


# ------------------------------------------------------------------------------------------ forward


def forward_logprobs(
    model: nn.Module, mb: TrainBatch, device: torch.device, packed: bool, entropy: bool, chunk: int = 1024
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token log-probs (and entropies) of a micro-batch, ``[B, L-1]`` like the padded batch's masks.

    Padded: the micro-batch is cut to its longest row (right padding makes that exact). Packed, when the
    rows' lengths differ (equal lengths run padded: nothing to remove): all rows' real tokens in ONE row
    with position ids restarting at 0 per sequence and no attention mask, which transformers turns into
    a block-diagonal causal mask (sdpa/eager) or varlen flash attention; the values are scattered back
    into the padded layout (zeros off the real tokens).
    """
    amp = getattr(model, "_rlbus_autocast", None)
    if amp is not None:
        with torch.autocast(device.type, dtype=amp):
            return _forward_logprobs(model, mb, device, packed, entropy, chunk)
    return _forward_logprobs(model, mb, device, packed, entropy, chunk)


def _forward_logprobs(
    model: nn.Module, mb: TrainBatch, device: torch.device, packed: bool, entropy: bool, chunk: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    from rlbus.modeling import token_logprobs

    lengths = mb.attention_mask.sum(-1).long()
    bsz, width = mb.input_ids.shape
    # Rows of one length have no padding to remove: the dense rows are the cheaper layout for the kernels
    # (measured on the H200: varlen over equal lengths ran ~5% below batched flash sdpa).
    if not packed or bool((lengths == lengths[0]).all()):
        w = max(int(lengths.max()), 2)
        out = token_logprobs(
            model,
            mb.input_ids[:, :w].to(device),
            mb.attention_mask[:, :w].to(device),
            mb.position_ids[:, :w].to(device),
            mb.temperature,
            return_entropy=entropy,
            chunk_tokens=chunk,
        )
        lp, ent = out if entropy else (out, None)
        pad = width - w
        if pad:
            lp = torch.nn.functional.pad(lp, (0, pad))
            ent = torch.nn.functional.pad(ent, (0, pad)) if ent is not None else None
        return lp, ent
    keep = torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)  # [B, L] real tokens (right padded)
    ids = mb.input_ids[keep].unsqueeze(0)
    pos = mb.position_ids[keep].unsqueeze(0)
    bounds = {}
    if getattr(getattr(model, "config", None), "_attn_implementation", None) == VARLEN_ATTENTION:
        # the sequence bounds, from host-side lengths: no device sync inside the (compiled) layers
        cu = torch.nn.functional.pad(torch.cumsum(lengths, 0), (1, 0)).to(device=device, dtype=torch.int32)
        max_len = int(lengths.max())
        bounds = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max_len, max_length_k=max_len)
    out = token_logprobs(
        model,
        ids.to(device),
        None,
        pos.to(device),
        mb.temperature,
        return_entropy=entropy,
        chunk_tokens=chunk,
        **bounds,
    )
    lp_p, ent_p = out if entropy else (out, None)
    # packed index j predicts packed token j + 1; row b's predictions t = 0..n_b-2 sit at offset_b + t
    offsets = torch.cumsum(lengths, 0) - lengths
    n_pred = (lengths - 1).clamp(min=0)
    rows = torch.repeat_interleave(torch.arange(bsz), n_pred)
    cols = torch.cat([torch.arange(int(n)) for n in n_pred]) if bsz else torch.zeros(0, dtype=torch.long)
    src = (torch.repeat_interleave(offsets, n_pred) + cols).to(device)
    rows, cols = rows.to(device), cols.to(device)

    def scatter(values: torch.Tensor) -> torch.Tensor:
        base = torch.zeros(bsz, width - 1, dtype=values.dtype, device=values.device)
        return base.index_put((rows, cols), values[0, src])

    return scatter(lp_p), scatter(ent_p) if ent_p is not None else None


# ------------------------------------------------------------------------------------------ varlen attention

VARLEN_ATTENTION = "rlbus_varlen"
_cu_cache: dict[str, Any] = {}
_VARLEN_PARAMS: frozenset[str] = frozenset()  # varlen_attn's keyword names in this torch, read once


def packed_attention(device: torch.device, compute_dtype: torch.dtype) -> str:
    """``attn_implementation`` for packed rows: varlen flash attention (``torch.nn.attention.varlen``) on
    CUDA in bf16/fp16, so a packed row costs the sum of its sequences' attention, not the whole row's.
    Elsewhere ``sdpa``, which transformers gives a block-diagonal causal mask from the position ids."""
    if device.type != "cuda" or compute_dtype not in (torch.bfloat16, torch.float16):
        return "sdpa"
    try:
        from torch.nn.attention.varlen import varlen_attn
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError:
        return "sdpa"
    global _VARLEN_PARAMS
    _VARLEN_PARAMS = frozenset(inspect.signature(varlen_attn).parameters)
    AttentionInterface.register(VARLEN_ATTENTION, _varlen_attention_forward)
    AttentionMaskInterface.register(VARLEN_ATTENTION, _varlen_mask)
    return VARLEN_ATTENTION


def _varlen_mask(*args: Any, **kwargs: Any) -> Any:
    """No mask for one (packed) row: the attention reads the sequence bounds from the position ids."""
    from transformers.masking_utils import sdpa_mask

    if kwargs.get("batch_size", args[0] if args else None) == 1:
        return None
    return sdpa_mask(*args, **kwargs)


@torch.compiler.disable  # host-side ints: one opaque op; the learner passes the bounds in instead
def _cu_seqlens(position_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Sequence starts (position 0) -> int32 cumulative lengths and the longest length, once per forward
    (for callers that do not pass ``cu_seq_lens_q``/``max_length_q``)."""
    # every layer gets the same position_ids object; holding it keeps its id from being reused
    if _cu_cache.get("pos") is not position_ids:
        pos = position_ids.reshape(-1)
        starts = torch.nonzero(pos == 0).flatten()
        if starts.numel() == 0 or int(starts[0]) != 0:
            starts = torch.cat([starts.new_zeros(1), starts])
        cu = torch.cat([starts, starts.new_tensor([pos.numel()])]).to(torch.int32)
        _cu_cache.update(pos=position_ids, value=(cu, int((cu[1:] - cu[:-1]).max())))
    return _cu_cache["value"]


def _varlen_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    from torch.nn.attention.varlen import varlen_attn
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    position_ids = kwargs.get("position_ids")
    if query.shape[0] != 1:  # a padded batch (scoring outside the packed path): plain sdpa with its mask
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    if position_ids is None or kwargs.get("sliding_window") or dropout:
        raise RuntimeError("varlen attention needs position ids, no sliding window and no dropout")
    if kwargs.get("cu_seq_lens_q") is not None and kwargs.get("max_length_q") is not None:
        cu, max_len = kwargs["cu_seq_lens_q"], int(kwargs["max_length_q"])
    else:
        cu, max_len = _cu_seqlens(position_ids)
    dev = query.device.type
    # autocast does not cover this op, and rotary embeddings leave q/k in fp32: use the compute dtype
    dt = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else value.dtype
    q = query[0].transpose(0, 1).to(dt).contiguous()  # [T, H, D]
    k = key[0].transpose(0, 1).to(dt)
    v = value[0].transpose(0, 1).to(dt)
    rep = q.shape[1] // k.shape[1]
    params = _VARLEN_PARAMS
    extra: dict[str, Any] = {}
    if rep > 1 and "enable_gqa" in params:
        extra["enable_gqa"] = True
    elif rep > 1:
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    if "window_size" in params:
        extra["window_size"] = (-1, 0)  # causal
    else:
        extra["is_causal"] = True
    head_dim = q.shape[-1]
    if "scale" in params:
        extra["scale"] = scaling
    elif scaling is not None and abs(scaling - head_dim**-0.5) > 1e-12:
        q = q * (scaling * head_dim**0.5)
    out = varlen_attn(q, k.contiguous(), v.contiguous(), cu, cu, max_len, max_len, **extra)
    if isinstance(out, tuple):
        out = out[0]
    return out.unsqueeze(0), None  # [1, T, H, D], like sdpa_attention_forward


# ------------------------------------------------------------------------------------------ throughput


def train_flops_per_token(config: Any, seq_len: float) -> float:
    """Model FLOPs of forward + backward per token (6 N + causal attention 6 L H s), no recompute counted.

    N counts every matmul weight (the lm_head too, not the embedding lookup); attention scores and the
    weighted sum are 2 * 2 * s * H per layer forward for a causal mask (half of a full s x s), x3 with the
    backward. Matches the PaLM-style MFU accounting up to the causal halving.
    """
    h = config.hidden_size
    layers = config.num_hidden_layers
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", heads) or heads
    head_dim = getattr(config, "head_dim", None) or h // heads
    inter = config.intermediate_size
    per_layer = h * heads * head_dim + 2 * h * kv * head_dim + heads * head_dim * h + 3 * h * inter
    n_matmul = layers * per_layer + h * config.vocab_size
    attn = 6 * layers * heads * head_dim * seq_len  # causal: 2 matmuls x 2 flops x s/2 x 3 (fwd+bwd)
    return 6.0 * n_matmul + attn


def mfu(tokens_per_s: float, flops_per_token: float, peak_flops: float, world: int = 1) -> float:
    return tokens_per_s * flops_per_token / (peak_flops * world) if peak_flops > 0 else math.nan
