"""The interface every rollout engine implements, so the rollout loop never knows which one it drives.

Log-prob convention (all engines, and the learner's recompute): the behaviour log-prob of a sampled
token is log_softmax(logits / T) at that position, over the full vocabulary, with T = temperature
(T = 1 when temperature is 0, i.e. greedy). top-k/top-p filtering changes what is sampled, not
the recorded log-prob.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from rlbus.messages import SamplingParams, WeightAnnouncement


@dataclass
class GenerationRequest:
    prompt_ids: list[int]
    n: int
    sampling: SamplingParams


@dataclass
class Completion:
    response_ids: list[int]
    logprobs: np.ndarray  # float32, one per response token
    text: str = ""
    finish_reason: str = "stop"  # "stop" | "length"
    extra: dict = field(default_factory=dict)


class RolloutEngine(ABC):
    """One model replica that samples completions and takes weight pushes from the learner."""

    name: str = "base"

    @property
    def weight_ranks(self) -> int:
        """How many ranks this replica occupies in the weight-broadcast group (its TP size)."""
        return 1

    @abstractmethod
    def generate(self, requests: list[GenerationRequest]) -> list[list[Completion]]:
        """Returns, for each request, its `n` completions (with behaviour log-probs)."""

    def warm_up(self, say: Callable[[str], None]) -> None:
        """Before the replica is ready: the compiling its first batches would otherwise stall on (`say` tells
        the operator what and how long). Engines that compile nothing lazily do nothing."""
        return None

    @abstractmethod
    def receive_weights(self, announcement: WeightAnnouncement, rank: int, timeout_s: float) -> None:
        """Joins (or reuses) the broadcast group of `announcement.epoch` at `rank`, receives every tensor,
        verifies the checksum, and swaps the weights in. Raises on timeout or mismatch; never half-swaps."""

    @property
    def weight_device(self) -> str:
        """Where the replica keeps its weights ('cpu', 'cuda:0'): decides the learner's transport to it."""
        return "cpu"

    @property
    def receives_while_generating(self) -> bool:
        """Whether `receive_weights` may run while `generate` does (the engine guards its own swap). Else
        the replica holds generation off for the whole receive, and a push waits for the batch in flight."""
        return False

    @property
    def weight_place(self) -> str | None:
        """Where the weights live when no torch device of this process names it (a remote server's GPU), as
        rlbus.weight_transport.DevicePlace prints it; None = `weight_device` says."""
        return None

    @property
    def per_tensor_weights(self) -> bool:
        """Whether weights arrive one broadcast per tensor in a group of the engine's own making (SGLang's
        endpoints) rather than in rlbus's verified buckets: the learner then announces a `tensor_group`."""
        return False

    @property
    def supports_ipc(self) -> bool:
        """Whether `take_ipc_weights`/`load_received` work here (the engine shares the learner's process
        model: weights in this process's CUDA memory)."""
        return False

    def take_ipc_weights(self, announcement: WeightAnnouncement) -> dict:
        """Copies the announced version out of the learner's CUDA IPC buffer, verified (no engine lock
        needed: generation goes on). The learner may refill the buffer once this returns."""
        raise NotImplementedError(f"the {self.name} engine cannot take weights over CUDA IPC")

    def load_received(self, received: dict, version: int) -> None:
        """Swaps in what `take_ipc_weights` returned (under the replica's engine lock)."""
        raise NotImplementedError(f"the {self.name} engine cannot take weights over CUDA IPC")

    @abstractmethod
    def score(self, prompt_ids: list[int], response_ids: list[int], temperature: float = 1.0) -> np.ndarray:
        """Log-probs the engine's current weights give `response_ids` after `prompt_ids` (tests, checks)."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Releases processes/memory; the default engine has nothing to release."""
