"""The message bus: NATS connection, JetStream work queues per stage, dead letters, run state.

Modules: `local_server` (a nats-server we start), `connect` (auth/TLS/reconnect), `subjects`
(names), `transport` (Bus: streams, publish, claim checks, DLQ), `consumer` (Consumer, Delivery),
`headers` (header names, limits, small types), `keepalive`, `retry`, `state` (RunState on KV).
"""

from rlbus.bus.connect import BusConnectError, connect, redact_url
from rlbus.bus.consumer import Consumer, Delivery
from rlbus.bus.headers import BusError, DeadLetter, PublishResult
from rlbus.bus.local_server import LocalNatsError, LocalNatsServer, resolve_bus_url
from rlbus.bus.state import RunState
from rlbus.bus.subjects import STAGE_MESSAGE, RunNames, Stage
from rlbus.bus.transport import Bus

__all__ = [
    "STAGE_MESSAGE",
    "Bus",
    "BusConnectError",
    "BusError",
    "Consumer",
    "DeadLetter",
    "Delivery",
    "LocalNatsError",
    "LocalNatsServer",
    "PublishResult",
    "RunNames",
    "RunState",
    "Stage",
    "connect",
    "redact_url",
    "resolve_bus_url",
]
