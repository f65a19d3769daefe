"""Versioned schemas of every message on the bus.

Flow: PromptWork -> (rollout) TrajectoryGroup -> (reward) ScoredGroup -> (ref) ReadyGroup -> learner.
Each later stage wraps the earlier message, so nothing a stage learnt is ever lost downstream.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal, TypeVar, overload

import numpy as np
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, PlainSerializer, ValidationError

from rlbus import codec

SCHEMA_VERSION = 1


def _as_float_array(value: Any) -> np.ndarray:
    arr = np.asarray(value, dtype=np.float32)
    if arr.ndim != 1:
        raise ValueError(f"expected a 1-D array, got shape {arr.shape}")
    return arr


FloatArray = Annotated[
    np.ndarray, BeforeValidator(_as_float_array), PlainSerializer(lambda a: a, return_type=Any)
]


class Message(BaseModel):
    """Base of all bus messages: frozen field set, explicit kind and schema version on the wire."""

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)
    kind: ClassVar[str]


M = TypeVar("M", bound=Message)


class SamplingParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 16
    stop: list[str] = Field(default_factory=list)
    seed: int | None = None
    ignore_eos: bool = Field(
        False, description="run to max_tokens past end tokens (benchmarks: fixed lengths)"
    )


class PromptWork(Message):
    """One prompt to sample `n` completions for: the unit of rollout work."""

    kind: ClassVar[str] = "prompt_work"
    run_id: str
    prompt_id: str = Field(description="unique per dispatch; the dedup id on JetStream")
    index: int = Field(description="position in the learner's data order")
    step: int = Field(description="learner step this work was dispatched for")
    min_policy_version: int = Field(ge=0, description="replicas must hold at least this version to generate")
    prompt_ids: list[int]
    prompt_text: str = ""
    meta: dict[str, Any] = Field(
        default_factory=dict, description="task fields a verifier needs, e.g. answer"
    )
    n: int = Field(ge=1)
    sampling: SamplingParams
    split: Literal["train", "val"] = "train"


class Sample(BaseModel):
    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)
    response_ids: list[int]
    logprobs: FloatArray = Field(description="behaviour log-prob of each response token")
    text: str = ""
    finish_reason: Literal["stop", "length", "abort"] = "stop"


class TrajectoryGroup(Message):
    """All samples of one PromptWork, made by one replica with one policy version."""

    kind: ClassVar[str] = "trajectory_group"
    work: PromptWork
    samples: list[Sample]
    policy_version: int = Field(ge=0)
    replica_id: str
    engine: str
    timings: dict[str, float] = Field(default_factory=dict)


class ScoredGroup(Message):
    kind: ClassVar[str] = "scored_group"
    trajectories: TrajectoryGroup
    rewards: list[float]
    correct: list[bool]
    reward_errors: list[str | None] = Field(default_factory=list)
    reward_impl: str = ""


class ReadyGroup(Message):
    """What the learner trains on: scored samples, plus reference log-probs when a KL term needs them."""

    kind: ClassVar[str] = "ready_group"
    scored: ScoredGroup
    ref_logprobs: list[FloatArray] | None = None


class IpcBuffer(BaseModel):
    """The learner's shared CUDA buffer (rlbus.weight_ipc): plain fields of torch's IPC handle, no pickle."""

    model_config = ConfigDict(extra="forbid")

    buffer_id: str = Field(description="changes whenever the learner allocates a new buffer (e.g. a restart)")
    device_uuid: str
    handle: bytes
    storage_size: int = Field(ge=0)
    storage_offset: int = Field(ge=0)
    ref_counter_handle: bytes
    ref_counter_offset: int = Field(ge=0)
    event_handle: bytes = b""
    event_sync_required: bool = False
    nbytes: int = Field(ge=0)


class TensorGroup(BaseModel):
    """The per-tensor group of a push (SGLang replicas): its own rendezvous, one broadcast per tensor in
    `names` order (rlbus.weight_sync.per_tensor)."""

    model_config = ConfigDict(extra="forbid")
    master_port: int
    world_size: int = Field(ge=1)
    ranks: dict[str, int] = Field(description="replica id -> rank offset (learner is rank 0)")
    backend: Literal["gloo", "nccl"] = "gloo"
    group_name: str = Field(description="the store prefix both sides use (SGLang's group_name)")


class WeightAnnouncement(Message):
    """Tells replicas a weight broadcast is coming: which group, which version, which tensors in which order."""

    kind: ClassVar[str] = "weight_announcement"
    run_id: str
    version: int = Field(ge=0)
    epoch: int = Field(ge=0, description="increments whenever the group's membership changes")
    master_addr: str
    master_port: int
    world_size: int = Field(ge=1)
    ranks: dict[str, int] = Field(description="replica id -> rank (learner is rank 0)")
    backend: Literal["gloo", "nccl"] = "gloo"
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    buckets: list[list[int]] = Field(description="tensor indices sent together in one flat broadcast")
    checksum: float = Field(description="sum of all values in fp64: the receiver checks it before swapping")
    ipc_replicas: list[str] = Field(
        default_factory=list, description="replicas that read `ipc_buffer` instead"
    )
    ipc_buffer: IpcBuffer | None = None
    new_group: bool = Field(
        True,
        description="the group of this epoch forms now; False = it is already formed "
        "(only its members from before can take part)",
    )
    tensor_group: TensorGroup | None = Field(
        None, description="replicas that receive per tensor (SGLang), in a group of their own"
    )
    timeout_s: float | None = Field(
        None,
        gt=0,
        description="the learner's trainer.weight_push_timeout_s: how long a receiver may wait on this push "
        "(None: an older learner; the replica uses its own copy of the key)",
    )


HOLDING_MAX = (
    4096  # ack subjects a heartbeat names at most (what it holds beyond them waits out the ack wait)
)


class Heartbeat(Message):
    kind: ClassVar[str] = "heartbeat"
    run_id: str
    service: Literal["learner", "rollout", "reward", "ref"]
    instance_id: str
    policy_version: int = 0
    time: float
    status: str = "ok"
    stats: dict[str, float] = Field(default_factory=dict)
    host: str = ""
    device: str = Field("", description="where the weights live: 'cpu' or 'cuda:<GPU UUID>' (rollout)")
    incarnation: str = Field(
        "",
        description="new at every process start: a restarted replica under the same "
        "id is a new member of the weight group",
    )
    holding: list[str] = Field(
        default_factory=list,
        max_length=HOLDING_MAX,
        description="ack subjects of the work this instance holds (rollout): once it is known gone, the "
        "learner hands that work back at once instead of after the stage's ack wait",
    )


class WeightAck(Message):
    kind: ClassVar[str] = "weight_ack"
    replica_id: str
    version: int
    epoch: int = 0
    ok: bool
    detail: str = ""


class JoinCall(Message):
    """The learner's roll call before it forms a weight group: only replicas that answer it join."""

    kind: ClassVar[str] = "join_call"
    run_id: str
    call_id: str  # the answers name it: a late answer to an earlier call counts for nothing


class JoinReply(Message):
    """A replica's answer to a roll call: its id and the process (incarnation) that answers."""

    kind: ClassVar[str] = "join_reply"
    call_id: str
    replica_id: str
    incarnation: str


ALL_MESSAGES: tuple[type[Message], ...] = (
    PromptWork,
    TrajectoryGroup,
    ScoredGroup,
    ReadyGroup,
    WeightAnnouncement,
    Heartbeat,
    WeightAck,
    JoinCall,
    JoinReply,
)
_BY_KIND = {m.kind: m for m in ALL_MESSAGES}


class MessageError(ValueError):
    """A frame that decoded but is not a valid message of the expected kind/version. `reason` says why."""


def encode(message: Message) -> bytes:
    body = message.model_dump(mode="python")
    return codec.pack({"kind": message.kind, "v": SCHEMA_VERSION, "body": body})


@overload
def decode(data: bytes, expected: type[M]) -> M: ...


@overload
def decode(data: bytes, expected: None = None) -> Message: ...


def decode(data: bytes, expected: type[Message] | None = None) -> Message:
    """Bytes -> validated message. Raises CodecError/MessageError with a reason fit for a dead letter."""
    frame = codec.unpack(data)
    if not isinstance(frame, dict) or not {"kind", "v", "body"} <= frame.keys():
        raise MessageError("frame is not an rlbus envelope {kind, v, body}")
    if frame["v"] != SCHEMA_VERSION:
        raise MessageError(f"schema version {frame['v']!r} is not {SCHEMA_VERSION}")
    cls = _BY_KIND.get(frame["kind"])
    if cls is None:
        raise MessageError(f"unknown message kind {frame['kind']!r}")
    if expected is not None and cls is not expected:
        raise MessageError(f"expected {expected.kind}, got {cls.kind}")
    try:
        return cls.model_validate(frame["body"])
    except ValidationError as exc:
        raise MessageError(f"invalid {cls.kind}: {exc.errors()[:3]}") from exc
