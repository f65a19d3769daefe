"""The roll call before a weight group forms (core NATS requests, one per replica): the learner's side asks
each replica it would take whether it is there, a replica's side answers with its id and process incarnation.
Only replicas that answer join the group (rlbus.learner.membership); a heartbeat alone is a claim, an answer
is evidence.

Each replica answers on its own subject, so a replica whose process is gone costs nothing to call: its
connection closed with it, the server holds no subscription for it, and NATS answers "no responders" at
once. A SIGKILLed replica (or a forged heartbeat nobody stands behind) used to cost the whole join window.
Only right after the caller's own connection came back (a NATS restart, when every replica is reconnecting
too) does "no responders" wait for the window, asking again until someone listens.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterable
from typing import Any

from nats.aio.client import Client
from nats.aio.subscription import Subscription
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError

from rlbus.bus.disconnects import RECENT_RECONNECT_S, disconnects_of
from rlbus.bus.flush import flush_through
from rlbus.bus.subjects import RunNames
from rlbus.messages import JoinCall, JoinReply, decode, encode

RECONNECT_GRACE_S = (
    3.0  # this long after the caller reconnected, "no responders" may be a reconnecting replica
)
NO_RESPONDERS_RETRY_S = 0.05  # how often such a replica is asked again within the window


async def roll_call(
    nc: Client,
    names: RunNames,
    wanted: Iterable[str],
    window_s: float,
    log: Any,
    reconnect_grace_s: float = RECENT_RECONNECT_S,
) -> dict[str, str]:
    """Call `wanted` replica ids to the roll; returns replica id -> incarnation of those that answered within
    `window_s`. It ends as soon as each has answered or is known to have nobody listening. A bus that cannot
    be reached means nobody answered."""
    wanted = sorted(set(wanted))
    if not wanted:
        return {}
    call = JoinCall(run_id=names.run_id, call_id=uuid.uuid4().hex)
    t0 = time.perf_counter()
    deadline = time.monotonic() + window_s
    patient = disconnects_of(nc).recently_reconnected(reconnect_grace_s)  # replicas may be reconnecting too
    answers = await asyncio.gather(
        *(_ask(nc, names.weight_join(rid), call, rid, deadline, patient, log) for rid in wanted)
    )
    answered = {rid: inc for rid, inc in zip(wanted, answers, strict=True) if inc is not None}
    log.info(
        "roll call",
        called=wanted,
        silent=sorted(set(wanted) - answered.keys()),
        seconds=round(time.perf_counter() - t0, 3),
    )
    return answered


async def _ask(
    nc: Client, subject: str, call: JoinCall, replica_id: str, deadline: float, patient: bool, log: Any
) -> str | None:
    """The incarnation `replica_id` answers with, or None (silent, nobody listening, or no bus)."""
    while (left := deadline - time.monotonic()) > 0:
        try:
            msg = await nc.request(subject, encode(call), timeout=left)
        except NoRespondersError:
            if not patient:
                return None
            await asyncio.sleep(min(NO_RESPONDERS_RETRY_S, max(deadline - time.monotonic(), 0.0)))
            continue
        except (NatsTimeoutError, TimeoutError):
            return None
        except Exception as exc:  # noqa: BLE001 - no bus now: nobody joins this time
            log.warning("roll call failed", replica=replica_id, error=str(exc))
            return None
        try:
            reply = decode(msg.data, JoinReply)
        except Exception as exc:  # noqa: BLE001 - a malformed answer counts for nothing
            log.warning("bad roll-call answer", replica=replica_id, error=str(exc))
            return None
        if reply.call_id == call.call_id and reply.replica_id == replica_id:
            return reply.incarnation
        return None
    return None


async def answer_roll_calls(
    nc: Client, names: RunNames, replica_id: str, incarnation: str, log: Any
) -> Subscription:
    """Answer every roll call of the run to `replica_id` (this process: `incarnation`). The subscription is
    flushed before this returns, so a caller that sees the replica's ready heartbeat finds it listening."""

    async def on_call(msg) -> None:
        try:
            call = decode(msg.data, JoinCall)
        except Exception as exc:  # noqa: BLE001 - a malformed call is logged and ignored
            log.warning("bad roll call", error=str(exc))
            return
        if call.run_id != names.run_id or not msg.reply:
            return
        reply = JoinReply(call_id=call.call_id, replica_id=replica_id, incarnation=incarnation)
        try:
            await nc.publish(msg.reply, encode(reply))
        except Exception as exc:  # noqa: BLE001 - the learner calls again at its next push
            log.warning("roll call not answered", error=str(exc))

    sub = await nc.subscribe(names.weight_join(replica_id), cb=on_call)
    await flush_through(nc)
    return sub


async def is_gone(nc: Client, names: RunNames, replica_id: str, timeout_s: float = 0.5) -> bool:
    """Whether `replica_id`'s process is gone: NATS answers at once that nobody listens on its roll-call
    subject. A live replica answers the call (False); so does silence or a bus of our own just back from a
    reconnect, when a live replica may still be reconnecting too (False: not known)."""
    if disconnects_of(nc).recently_reconnected(RECONNECT_GRACE_S):
        return False
    call = JoinCall(run_id=names.run_id, call_id=uuid.uuid4().hex)
    try:
        await nc.request(names.weight_join(replica_id), encode(call), timeout=timeout_s)
    except NoRespondersError:
        return True
    except Exception:  # noqa: BLE001 - silent or no bus: not known to be gone
        return False
    return False
