"""The trajectory log: every group the learner trained, kept in a retained stream of the run (limits by age
and bytes, `bus.trajectory_log*`), with the step it was trained in. Work streams are work queues, emptied as
each stage acks; this one keeps what was learned from, so a run can be audited or exported after the fact
(`rlbus replay`, rlbus.replay).

A group is logged under `<prompt id>:trained`, so a retried publish is stored once. A learner restart that
trains a step again logs that step's new groups too; the run's ledger says which attempt's groups count, and
the export keeps only those.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from nats.js import api as js_api
from nats.js.errors import NotFoundError

from rlbus.bus.connect import log
from rlbus.bus.headers import DUPLICATE_WINDOW_S, MSG_ID_HEADER, _storage
from rlbus.bus.retry import with_retry
from rlbus.bus.streams import add_or_update
from rlbus.bus.transport import Bus
from rlbus.messages import ReadyGroup, decode, encode

STEP_HEADER = "Rlbus-Trained-Step"


class TrajectoryLog:
    """The learner's side: appends each step's trained groups."""

    def __init__(self, bus: Bus, max_age_h: float, max_gb: float) -> None:
        self.bus = bus
        self.max_age_s = max_age_h * 3600.0
        self.max_bytes = int(max_gb * 1024**3)
        self.skipped = 0  # groups too large for one message, not logged

    async def ensure(self) -> None:
        names = self.bus.names
        await add_or_update(
            self.bus.js,
            js_api.StreamConfig(
                name=names.trained_stream,
                subjects=[names.trained_subject],
                retention=js_api.RetentionPolicy.LIMITS,
                storage=_storage(self.bus.cfg.storage),
                max_age=self.max_age_s,
                max_bytes=self.max_bytes,
                max_msg_size=-1,
                duplicate_window=DUPLICATE_WINDOW_S,
                discard=js_api.DiscardPolicy.OLD,
                num_replicas=self.bus.cfg.stream_replicas,
            ),
        )

    async def append(self, step: int, groups: list[ReadyGroup]) -> int:
        """Log the groups trained in `step` (1-based, as in metrics.jsonl); returns how many were stored."""
        stored = await asyncio.gather(*(self._one(step, g) for g in groups))
        return sum(stored)

    async def _one(self, step: int, group: ReadyGroup) -> bool:
        data = encode(group)
        pid = group.scored.trajectories.work.prompt_id
        if len(data) > self.bus.inline_limit:
            self.skipped += 1
            log.warning("trajectory log: group too large for one message; not logged", prompt_id=pid)
            return False
        headers = {MSG_ID_HEADER: f"{pid}:trained", STEP_HEADER: str(step)}
        subject, stream = self.bus.names.trained_subject, self.bus.names.trained_stream
        ack = await with_retry(
            "log trained group",
            lambda: self.bus.js.publish(subject, data, stream=stream, headers=dict(headers)),
            nc=self.bus.nc,
        )
        return not ack.duplicate


async def read_trajectory_log(bus: Bus) -> AsyncIterator[tuple[int, ReadyGroup]]:
    """Every logged (step, group) still retained, oldest first."""
    stream = bus.names.trained_stream
    try:
        info = await bus.js.stream_info(stream)
    except NotFoundError as exc:
        raise LookupError(
            f"run {bus.run_id!r} has no trajectory log (it ran without bus.trajectory_log)"
        ) from exc
    first, last = int(info.state.first_seq), int(info.state.last_seq)
    for seq in range(first, last + 1):
        try:
            msg = await bus.js.get_msg(stream, seq=seq)
        except NotFoundError:
            continue  # aged out or deleted
        step = int((msg.headers or {}).get(STEP_HEADER, "0"))
        yield step, decode(msg.data or b"", ReadyGroup)
