"""vLLM plugin: an rlbus weight-transfer engine for vLLM's native RL weight-update API.

Why a plugin: vLLM builds its weight-transfer engine inside every worker process from
`vllm.distributed.weight_transfer.factory.WeightTransferEngineFactory`, so a custom backend must be
registered in those processes too. vLLM runs every `vllm.general_plugins` entry point in the driver,
the engine core and each worker; pyproject.toml points `rlbus_gloo` at `register` below.

Why our own engine: vLLM's CPU build has no NCCL and its `nccl` engine then silently does nothing,
and its rendezvous (StatelessProcessGroup + PyNccl) is not the torch process group our learner's
`rlbus.weight_sync.WeightSender` opens. This engine joins the learner's group with
`rlbus.weight_sync.WeightReceiver` (gloo on CPU, nccl on GPU: the same code), receives the
announced flat buckets, verifies the checksum, and only then loads the weights through vLLM's
layerwise reload, the way vLLM's own nccl engine loads them. Receiving everything before loading
anything is what makes a failed push leave the old weights in place (never a half swap).

Phases (driven by `VLLMEngine.receive_weights` through `LLM.init_weight_transfer_engine` /
`start_weight_update` / `update_weights` / `finish_weight_update`):
  init   -> join the group of one epoch at rank `rank_offset + this worker's rank`;
  start  -> drop anything staged;
  update -> receive every bucket, check the checksum, stage the tensors;
  finish -> initialize_layerwise_reload, model.load_weights(staged), finalize_layerwise_reload.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.config.weight_transfer import WeightTransferConfig

ENGINE_NAME = "rlbus"
"""The `WeightTransferConfig(backend=...)` name this plugin registers."""


def register() -> None:
    """vLLM `general_plugins` hook: runs in every vLLM process, possibly more than once."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if ENGINE_NAME not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(ENGINE_NAME, RlbusWeightTransferEngine)


def _tied_groups(model: torch.nn.Module) -> list[list[torch.nn.Module]]:
    """Modules that share one weight Parameter (a tied lm_head and its embed_tokens)."""
    owners: dict[int, list[torch.nn.Module]] = {}
    for module in model.modules():
        weight = module._parameters.get("weight")
        if weight is not None and getattr(module, "quant_method", None) is not None:
            owners.setdefault(id(weight), []).append(module)
    return [mods for mods in owners.values() if len(mods) > 1]


def _reprocess_tied_layers(groups: list[list[torch.nn.Module]]) -> None:
    """Re-run weight post-processing on layers that share their weight with another layer (tied lm_head).

    Layerwise reload processes a tied weight only through the layer that loads it (embed_tokens; its
    documented limitation 2). On CPU, post-processing packs the weight into the layer's `cpu_linear`
    GEMM closure, so the tied lm_head would keep computing logits from the OLD packed embedding.
    Embedding-family methods keep their weight (remove_weight=False), so re-processing them is safe.
    """
    for modules in groups:
        for module in modules:
            cast(Any, module).quant_method.process_weights_after_loading(module)


class _ExpectedReloadWarnings(logging.Filter):
    """Drops layerwise reload's "<Layer>: Failed to load weights" for layers that have nothing to load by
    design (tied lm_head, parameter-free RotaryEmbedding), so a real miss still stands out in the log."""

    def __init__(self, quiet: set[str]) -> None:
        super().__init__()
        self.quiet = quiet

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg == "%s: Failed to load weights" and isinstance(record.args, tuple) and record.args:
            return record.args[0] not in self.quiet
        return True


def _nothing_to_load(model: torch.nn.Module, tied: list[list[torch.nn.Module]]) -> set[str]:
    names = {type(m).__name__ for mods in tied for m in mods[1:]}
    # Parameter-free layers (RotaryEmbedding: only a cos/sin buffer) never get checkpoint weights.
    with_params = {type(m).__name__ for m in model.modules() if m._parameters}
    names |= {type(m).__name__ for m in model.modules() if not m._parameters} - with_params
    return names


@dataclass
class RlbusInitInfo(WeightTransferInitInfo):
    """Where the learner's group of one epoch listens; the worker adds its own rank to `rank_offset`."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    backend: str = "gloo"
    epoch: int = 0
    timeout_s: float = 120.0


@dataclass
class RlbusUpdateInfo(WeightTransferUpdateInfo):
    """One announcement's tensor list, bucket layout and checksum (see rlbus.messages.WeightAnnouncement)."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    buckets: list[list[int]]
    checksum: float
    version: int = 0

    def __post_init__(self) -> None:
        if not (len(self.names) == len(self.dtype_names) == len(self.shapes)):
            raise ValueError(
                f"names/dtype_names/shapes differ in length: "
                f"{len(self.names)}/{len(self.dtype_names)}/{len(self.shapes)}"
            )
        covered = sorted(i for bucket in self.buckets for i in bucket)
        if covered != list(range(len(self.names))):
            raise ValueError("buckets must cover every tensor index exactly once")


class RlbusWeightTransferEngine(WeightTransferEngine[RlbusInitInfo, RlbusUpdateInfo]):
    """Worker side of an rlbus weight push: receive over our torch group, verify, then layerwise reload."""

    init_info_cls = RlbusInitInfo
    update_info_cls = RlbusUpdateInfo
    supports_draft_weight_update = False

    def __init__(
        self,
        config: WeightTransferConfig,
        vllm_config: VllmConfig,
        device: torch.device,
        model: torch.nn.Module,
    ) -> None:
        super().__init__(config, vllm_config, device, model)
        self._receiver: Any = None
        self._staged: list[tuple[str, torch.Tensor]] | None = None
        self.rank: int | None = None
        self.version: int | None = None

    def worker_rank(self, rank_offset: int) -> int:
        """rank_offset + this worker's index among all of this engine's workers (dp * tp*pp + rank)."""
        pc = self.parallel_config
        return int(rank_offset) + pc.data_parallel_index * pc.world_size + pc.rank

    def init_transfer_engine(self, init_info: RlbusInitInfo) -> None:
        from rlbus.weight_sync import WeightReceiver

        if init_info.backend not in ("gloo", "nccl"):
            raise ValueError(f"unsupported weight backend {init_info.backend!r}")
        # gloo moves CPU tensors (staged, then copied to the model's device); nccl receives on our GPU.
        device = self.device if init_info.backend == "nccl" else torch.device("cpu")
        if self._receiver is None or getattr(self._receiver, "device", None) != device:
            self.shutdown()
            self._receiver = WeightReceiver(device=device)
        rank = self.worker_rank(init_info.rank_offset)
        # A no-op when this epoch's group is already joined; an older epoch's group is closed first.
        self._receiver.connect(
            init_info.master_address,
            init_info.master_port,
            rank,
            init_info.world_size,
            init_info.backend,
            init_info.epoch,
            init_info.timeout_s,
        )
        self.rank = rank

    def start_weight_update(self) -> None:
        self._staged = None

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class ends with torch.accelerator.synchronize(), which has nothing to sync on CPU;
        # our receive is synchronous anyway (every broadcast is waited on).
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: RlbusUpdateInfo) -> None:
        from rlbus.weight_sync import metas_from_lists

        receiver = self._receiver
        if receiver is None:
            raise RuntimeError(
                "rlbus weight transfer not initialized: call init_weight_transfer_engine first"
            )
        self._staged = None
        metas = metas_from_lists(update_info.names, update_info.dtype_names, update_info.shapes)
        try:
            # Every bucket's digest and the total checksum are checked before this returns.
            received = receiver.receive(metas, update_info.buckets, update_info.checksum)
        except BaseException:
            if not receiver.is_connected:  # broken group: the learner opens a new epoch, we rejoin then
                self.shutdown()
            raise
        self._staged = [(name, received[name]) for name in update_info.names]
        self.version = update_info.version

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        staged, self._staged = self._staged, None
        if staged is None:
            raise RuntimeError("finish_weight_update without a verified update: nothing to load")
        device_staged = [(n, t.to(self.device, non_blocking=True)) for n, t in staged]
        del staged
        tied = _tied_groups(self.model)
        quiet = _ExpectedReloadWarnings(_nothing_to_load(self.model, tied))
        reload_logger = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
        reload_logger.addFilter(quiet)
        try:
            initialize_layerwise_reload(self.model)
            try:
                cast(Any, self.model).load_weights(device_staged)
            finally:
                finalize_layerwise_reload(self.model, self.model_config)
        finally:
            reload_logger.removeFilter(quiet)
        _reprocess_tied_layers(tied)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def shutdown(self) -> None:
        receiver, self._receiver = self._receiver, None
        self._staged = None
        if receiver is not None:
            close = getattr(receiver, "close", None)
            if close is not None:
                try:
                    close()
                except Exception:  # noqa: BLE001 - tearing down a dead group must not mask the real error
                    pass
