"""The run's JetStream streams: one work queue per stage and partition, and the dead-letter stream.

Each partition is a stream of its own, so on a cluster each has its own leader and no stage is bound by one
server's stream. Creating what exists with the same setup is a no-op; a changed setup is updated in place
when JetStream allows it.
"""

from __future__ import annotations

import asyncio

from nats.js import JetStreamContext
from nats.js import api as js_api
from nats.js.errors import BadRequestError

from rlbus.bus.headers import DLQ_MAX_AGE_S, DLQ_MAX_MSGS, DUPLICATE_WINDOW_S, BusError
from rlbus.bus.subjects import RunNames, Stage

CREATE_RACE_TRIES = 5  # tries of a stream another service is creating at the same moment


async def add_or_update(js: JetStreamContext, config: js_api.StreamConfig) -> None:
    for attempt in range(1, CREATE_RACE_TRIES + 1):
        try:
            await js.add_stream(config)
            return
        except BadRequestError as exc:
            # "subjects overlap with an existing stream": while another service's create of this very stream
            # is in flight, the server sees its subjects taken and the name free (a replica crashed on it at
            # start); once it exists, adding it again is a no-op. An overlap that lasts is a real one.
            if exc.err_code == 10065 and attempt < CREATE_RACE_TRIES:
                await asyncio.sleep(0.1 * attempt)
                continue
            if exc.err_code != 10058:  # "stream name already in use with a different configuration"
                raise
        try:
            await js.update_stream(config)
            return
        except BadRequestError as exc2:
            raise BusError(
                f"stream {config.name} exists with a setup that cannot change to what this run asks "
                f"({exc2.description}); delete the run (`rlbus up --fresh`) or use the same bus.storage"
            ) from exc2


async def ensure_work_streams(
    js: JetStreamContext, names: RunNames, storage: js_api.StorageType, replicas: int
) -> None:
    """Every stage's partitions as work-queue streams, and the DLQ; `replicas` copies of each."""
    for stage in Stage:
        for stream, subject in zip(names.streams(stage), names.subjects(stage), strict=True):
            await add_or_update(
                js,
                js_api.StreamConfig(
                    name=stream,
                    subjects=[subject],
                    retention=js_api.RetentionPolicy.WORK_QUEUE,
                    storage=storage,
                    max_msg_size=-1,
                    duplicate_window=DUPLICATE_WINDOW_S,
                    discard=js_api.DiscardPolicy.OLD,
                    num_replicas=replicas,
                ),
            )
    await add_or_update(
        js,
        js_api.StreamConfig(
            name=names.dlq_stream,
            num_replicas=replicas,
            subjects=[names.dlq_wildcard],
            retention=js_api.RetentionPolicy.LIMITS,
            storage=storage,
            max_msg_size=-1,
            max_msgs=DLQ_MAX_MSGS,
            max_age=DLQ_MAX_AGE_S,
            duplicate_window=DUPLICATE_WINDOW_S,
            discard=js_api.DiscardPolicy.OLD,
        ),
    )
