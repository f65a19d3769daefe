"""Names of everything a run owns on NATS, so no service ever spells a subject by hand.

Every name carries the run id: two runs (or two tests) on one server never see each other's work.
"""

from __future__ import annotations

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


@dataclass(frozen=True)
class RunNames:
    """Subjects, streams and buckets of one run."""

    run_id: str

    def __post_init__(self) -> None:
        if not _RUN_ID_RE.match(self.run_id):
            raise ValueError(f"run id {self.run_id!r} must match {_RUN_ID_RE.pattern} (it names streams)")

    @property
    def prefix(self) -> str:
        return f"rlbus.{self.run_id}"

    def subject(self, stage: Stage | str) -> str:
        return f"{self.prefix}.{Stage(stage).value}"

    def stream(self, stage: Stage | str) -> str:
        return f"RLBUS_{self.run_id}_{Stage(stage).value.upper()}"

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
    def work_streams(self) -> dict[Stage, str]:
        return {stage: self.stream(stage) for stage in Stage}

    def all_streams(self) -> list[str]:
        """Every JetStream stream of the run, including the ones behind the KV and object buckets."""
        return [
            *self.work_streams.values(),
            self.dlq_stream,
            f"OBJ_{self.blobs_bucket}",
            f"KV_{self.state_bucket}",
        ]
