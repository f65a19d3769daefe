"""Names of everything a run owns on NATS, so no service ever spells a subject by hand.

Every name carries the run id: two runs (or two tests) on one server never see each other's work.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from enum import StrEnum

from rlbus.messages import Message, PromptWork, ReadyGroup, ScoredGroup, TrajectoryGroup

_RUN_ID_RE = re.compile(r"^[A-Za-z0-9_-]+$")


class Stage(StrEnum):
    """The four work queues of the pipeline, in flow order."""

    PROMPTS = "prompts"
    TRAJECTORIES = "trajectories"
    SCORED = "scored"
    READY = "ready"


STAGE_MESSAGE: dict[Stage, type[Message]] = {
    Stage.PROMPTS: PromptWork,
    Stage.TRAJECTORIES: TrajectoryGroup,
    Stage.SCORED: ScoredGroup,
    Stage.READY: ReadyGroup,
}
"""The message type each stage carries: a consumer validates against it unless told otherwise."""


def partition_of(key: str, partitions: int) -> int:
    """A stable hash of `key` onto 0..partitions-1 (blake2b: the same in every process and Python version,
    unlike hash())."""
    if partitions <= 1:
        return 0
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % partitions


def partition_key(message: Message) -> str | None:
    """The prompt id a work message is about, at whichever stage it is (None for other messages)."""
    if isinstance(message, PromptWork):
        return message.prompt_id
    if isinstance(message, TrajectoryGroup):
        return message.work.prompt_id
    if isinstance(message, ScoredGroup):
        return message.trajectories.work.prompt_id
    if isinstance(message, ReadyGroup):
        return message.scored.trajectories.work.prompt_id
    return None


@dataclass(frozen=True)
class RunNames:
    """Subjects, streams and buckets of one run. With `partitions` > 1 each stage is that many subjects, each
    with a stream of its own (its own leader on a cluster); partition 0 keeps the unpartitioned names."""

    run_id: str
    partitions: int = 1

    def __post_init__(self) -> None:
        if not _RUN_ID_RE.match(self.run_id):
            raise ValueError(f"run id {self.run_id!r} must match {_RUN_ID_RE.pattern} (it names streams)")
        if self.partitions < 1:
            raise ValueError(f"partitions must be at least 1, not {self.partitions}")

    @property
    def prefix(self) -> str:
        return f"rlbus.{self.run_id}"

    def subject(self, stage: Stage | str, partition: int = 0) -> str:
        base = f"{self.prefix}.{Stage(stage).value}"
        return base if partition == 0 else f"{base}.{partition}"

    def stream(self, stage: Stage | str, partition: int = 0) -> str:
        base = f"RLBUS_{self.run_id}_{Stage(stage).value.upper()}"
        return base if partition == 0 else f"{base}_P{partition}"

    def subjects(self, stage: Stage | str) -> list[str]:
        """Every partition's subject of `stage`."""
        return [self.subject(stage, k) for k in range(self.partitions)]

    def streams(self, stage: Stage | str) -> list[str]:
        """Every partition's stream of `stage`."""
        return [self.stream(stage, k) for k in range(self.partitions)]

    def partition_of(self, key: str) -> int:
        """The partition a work item with this key (its prompt id) goes to: the same one at every stage and
        on every retry, so JetStream's msg-id deduplication (per stream) still sees every copy."""
        return partition_of(key, self.partitions)

    @property
    def weight_ack(self) -> str:
        """Core-NATS subject of CUDA IPC replicas' per-version acks (only the waiting push cares)."""
        return f"{self.prefix}.weights.ack"

    def weight_join(self, replica_id: str) -> str:
        """Core-NATS subject of the learner's roll calls to one replica (rlbus.messages.JoinCall); answers go
        to the caller's inbox. One subject per replica, so NATS itself says at once when nobody listens."""
        return f"{self.prefix}.weights.join.{replica_id}"

    def dlq_subject(self, stage: Stage | str) -> str:
        return f"{self.prefix}.dlq.{Stage(stage).value}"

    @property
    def dlq_wildcard(self) -> str:
        return f"{self.prefix}.dlq.>"

    @property
    def dlq_stream(self) -> str:
        return f"RLBUS_{self.run_id}_DLQ"

    @property
    def blobs_bucket(self) -> str:
        return f"rlbus_{self.run_id}_blobs"

    @property
    def state_bucket(self) -> str:
        return f"rlbus_{self.run_id}_state"

    @property
    def trained_subject(self) -> str:
        """The trajectory log's subject: every trained group (rlbus.bus.trajectory_log)."""
        return f"{self.prefix}.trained"

    @property
    def trained_stream(self) -> str:
        return f"RLBUS_{self.run_id}_TRAINED"

    def all_streams(self) -> list[str]:
        """Every JetStream stream of the run, including the ones behind the KV and object buckets."""
        return [
            *(stream for stage in Stage for stream in self.streams(stage)),
            self.dlq_stream,
            self.trained_stream,
            f"OBJ_{self.blobs_bucket}",
            f"KV_{self.state_bucket}",
        ]
