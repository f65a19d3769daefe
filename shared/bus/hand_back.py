"""Work a dead replica held goes back on the queue at once, not after the stage's ack wait.

A replica SIGKILLed mid-generation leaves its prompts un-acked, and the server hands them to another replica
only once their ack wait runs out (rlbus.bus.keepalive: 4 s). Meanwhile the learner's pipeline runs that
many prompts short: in the heavy fault run every rollout SIGKILL cost its steps ~0.1 s each until the
work came back. A replica therefore names the ack subjects of the work it holds in its heartbeat
(`Heartbeat.holding`, beat as soon as it fetches); once the learner knows the process is gone (NATS says
nobody listens on its roll-call subject, rlbus.bus.roll_call.is_gone), it sends a NAK to each, and the
server redelivers them at once. A NAK for work already acked is ignored by the server.
"""

from __future__ import annotations

from collections.abc import Iterable

from nats.aio.client import Client

from rlbus.bus.flush import flush_through

NAK = b"-NAK"
ROLLOUT_DURABLE = "rollout"  # the replicas' shared consumer of prompt work


def ours_to_hand_back(holding: Iterable[str], streams: Iterable[str], durable: str) -> list[str]:
    """The subjects in `holding` that are acks of `durable`'s deliveries from `streams`: a heartbeat names
    them, and nothing it names is sent to unless it is one (`$JS.ACK.<stream>.<durable>.<tokens>`)."""
    prefixes = tuple(f"$JS.ACK.{stream}.{durable}." for stream in streams)
    return [
        subject
        for subject in holding
        if subject.startswith(prefixes) and not any(c in subject for c in " \t\r\n*>")
    ]


async def hand_back(nc: Client, ack_subjects: Iterable[str]) -> int:
    """NAK each delivery: the server hands it to the next consumer that fetches. Returns how many were sent."""
    sent = 0
    for subject in ack_subjects:
        await nc.publish(subject, NAK)
        sent += 1
    if sent:
        await flush_through(nc)
    return sent
