"""Which transport carries the learner's weights to each replica: pure rules over where both sides live.

A replica's place is its device kind and, on CUDA, the GPU's UUID (indices differ between processes with
other CUDA_VISIBLE_DEVICES; UUIDs do not). The rule of `trainer.weight_sync_backend=auto`:

- the learner's own GPU            -> `cuda_ipc` (NCCL refuses two ranks on one GPU; IPC is a device copy)
- CUDA on both sides, other GPUs   -> `nccl`
- anything else (CPU, mixed)       -> `gloo`, staged through host memory

A forced choice that cannot work is refused with a message naming the key, never tried and retried.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

Transport = Literal["cuda_ipc", "nccl", "gloo"]
Choice = Literal["auto", "cuda_ipc", "nccl", "gloo"]
KEY = "trainer.weight_sync_backend"


class PlacementError(ValueError):
    """A placement/transport combination that cannot work; the message names the key to change."""


@dataclass(frozen=True)
class DevicePlace:
    """Where a process keeps its weights: `cpu`, or `cuda` plus the GPU's UUID."""

    kind: Literal["cpu", "cuda"]
    uuid: str = ""

    def __str__(self) -> str:
        return f"cuda:{self.uuid}" if self.kind == "cuda" else "cpu"

    @classmethod
    def parse(cls, text: str) -> DevicePlace:
        """Inverse of str(); an empty or unknown string (an older replica's heartbeat) reads as cpu."""
        if text.startswith("cuda:") and len(text) > 5:
            return cls("cuda", text[5:])
        return cls("cpu")


def device_place(device: object) -> DevicePlace:
    """The place of a torch device in this process (CUDA index resolved to its UUID)."""
    import torch

    dev = torch.device(str(device)) if not isinstance(device, torch.device) else device
    if dev.type != "cuda":
        return DevicePlace("cpu")
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    return DevicePlace("cuda", str(torch.cuda.get_device_properties(index).uuid))


def choose_transport(
    choice: Choice, learner: DevicePlace, replica: DevicePlace, replica_id: str = "", replica_ipc: bool = True
) -> Transport:
    """The transport for one replica, or PlacementError when the forced `choice` cannot reach it.

    `replica_ipc` says whether the replica's engine can load from a CUDA IPC buffer; one on the learner's GPU
    that cannot falls back to gloo under auto (NCCL would refuse the shared GPU)."""
    who = f"replica {replica_id} ({replica})" if replica_id else f"a replica on {replica}"
    same_gpu = learner.kind == replica.kind == "cuda" and learner.uuid == replica.uuid
    both_cuda = learner.kind == replica.kind == "cuda"
    if choice == "auto":
        if same_gpu:
            return "cuda_ipc" if replica_ipc else "gloo"
        return "nccl" if both_cuda else "gloo"
    if choice == "gloo":
        return "gloo"
    if choice == "cuda_ipc":
        if not same_gpu:
            raise PlacementError(
                f"{KEY}=cuda_ipc needs every replica on the learner's GPU ({learner}), but {who} is not: "
                f"set {KEY}=auto (IPC where it can, NCCL or gloo elsewhere)"
            )
        if not replica_ipc:
            raise PlacementError(
                f"{KEY}=cuda_ipc: {who} runs an engine that cannot load weights from CUDA IPC (the embedded hf "
                f"engine can): set {KEY}=auto"
            )
        return "cuda_ipc"
    if choice == "nccl":
        if same_gpu:
            raise PlacementError(
                f"{KEY}=nccl cannot reach {who}: it shares the learner's GPU and NCCL refuses two ranks on one "
                f"GPU; set {KEY}=auto or cuda_ipc"
            )
        if not both_cuda:
            raise PlacementError(
                f"{KEY}=nccl moves CUDA tensors, but the learner is on {learner} and {who}: set {KEY}=auto or gloo"
            )
        return "nccl"
    raise PlacementError(f"{KEY}={choice!r} is not one of auto, cuda_ipc, nccl, gloo")


def deal_ranks(sizes: dict[str, int]) -> tuple[dict[str, int], int]:
    """Group ranks for replicas (id -> ranks it needs), in id order after the learner's rank 0: (each
    replica's first rank, the world size)."""
    ranks, nxt = {}, 1
    for rid in sorted(sizes):
        ranks[rid] = nxt
        nxt += sizes[rid]
    return ranks, nxt


def group_backend(transports: Iterable[Transport]) -> Literal["nccl", "gloo"] | None:
    """One torch group serves every non-IPC replica: NCCL when all can take it, else gloo; None if none."""
    kinds = {t for t in transports if t != "cuda_ipc"}
    if not kinds:
        return None
    return "nccl" if kinds == {"nccl"} else "gloo"


def require_cuda(choice: Choice, side: str, kind: str) -> None:
    """`nccl` and `cuda_ipc` move CUDA tensors: a side (the config key `side`) on `kind` cpu cannot take part."""
    if choice in ("nccl", "cuda_ipc") and kind != "cuda":
        raise PlacementError(
            f"{KEY}={choice} needs CUDA on both sides, but {side} resolves to cpu: set {KEY}=auto or gloo, "
            f"or put {side} on a GPU"
        )


def check_config_placement(choice: Choice, learner_device: str, rollout_device: str, gpus: int) -> None:
    """Start-up check of what the config alone decides (devices 'auto' | 'cpu' | 'cuda[:i]', visible GPUs).

    Refuses combinations no replica could ever satisfy, before any process starts: `nccl` or `cuda_ipc`
    with a CPU side, and `nccl` when learner and rollout can only land on the same single GPU.
    """

    def kind(dev: str) -> str:
        if dev == "auto":
            return "cuda" if gpus > 0 else "cpu"
        return "cuda" if dev.startswith("cuda") else "cpu"

    require_cuda(choice, "trainer.device", kind(learner_device))
    require_cuda(choice, "rollout.device", kind(rollout_device))
    if choice == "nccl" and gpus == 1:
        raise PlacementError(
            f"{KEY}=nccl with one visible GPU puts the learner and the rollout on the same GPU, and NCCL refuses "
            f"two ranks on one GPU: set {KEY}=auto (CUDA IPC there) or cuda_ipc"
        )
    if choice == "cuda_ipc" and learner_device.startswith("cuda:") and rollout_device.startswith("cuda:"):
        if learner_device != rollout_device:
            raise PlacementError(
                f"{KEY}=cuda_ipc needs the rollout on the learner's GPU, but trainer.device={learner_device} and "
                f"rollout.device={rollout_device}: set {KEY}=auto"
            )
