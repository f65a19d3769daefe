"""The roll call before a weight group forms (core NATS request, many answers): the learner's side asks who is
there, a replica's side answers with its id and process incarnation. Only replicas that answer join the group
(rlbus.learner.membership); a heartbeat alone is a claim, an answer is evidence."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterable
from typing import Any

from nats.aio.client import Client
from nats.aio.subscription import Subscription

from rlbus.bus.subjects import RunNames
from rlbus.messages import JoinCall, JoinReply, decode, encode


async def roll_call(
    nc: Client, names: RunNames, wanted: Iterable[str], window_s: float, log: Any
) -> dict[str, str]:
    """Call `wanted` replica ids to the roll; returns replica id -> incarnation of those that answered within
    `window_s` (it ends as soon as all did). A bus that cannot be reached means nobody answered."""
    wanted = set(wanted)
    if not wanted:
        return {}
    call_id = uuid.uuid4().hex
    answered: dict[str, str] = {}
    everyone = asyncio.Event()

    async def on_reply(msg) -> None:
        try:
            reply = decode(msg.data, JoinReply)
        except Exception as exc:  # noqa: BLE001 - a malformed answer counts for nothing
            log.warning("bad roll-call answer", error=str(exc))
            return
        if reply.call_id == call_id and reply.replica_id in wanted:
            answered[reply.replica_id] = reply.incarnation
            if wanted <= answered.keys():
                everyone.set()

    t0 = time.perf_counter()
    sub: Subscription | None = None
    try:
        inbox = nc.new_inbox()
        sub = await nc.subscribe(inbox, cb=on_reply)
        call = JoinCall(run_id=names.run_id, call_id=call_id)
        await nc.publish(names.weight_join, encode(call), reply=inbox)
        try:
            await asyncio.wait_for(everyone.wait(), timeout=window_s)
        except TimeoutError:
            pass
    except Exception as exc:  # noqa: BLE001 - no bus now: nobody joins this time
        log.warning("roll call failed", error=str(exc))
    finally:
        if sub is not None:
            try:
                await sub.unsubscribe()
            except Exception as exc:  # noqa: BLE001 - the connection is gone
                log.debug("roll call unsubscribe", error=str(exc))
    log.info(
        "roll call",
        called=sorted(wanted),
        silent=sorted(wanted - answered.keys()),
        seconds=round(time.perf_counter() - t0, 3),
    )
    return dict(answered)


async def answer_roll_calls(
    nc: Client, names: RunNames, replica_id: str, incarnation: str, log: Any
) -> Subscription:
    """Answer every roll call of the run as `replica_id` (this process: `incarnation`)."""

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

    return await nc.subscribe(names.weight_join, cb=on_call)
