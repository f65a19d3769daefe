"""`make test-compose`: the compose stack's NATS refuses an anonymous client, and a client with the rollout
role's key may publish trajectories but not ready groups.

    python tests/cluster/auth_probe.py nats://127.0.0.1:14222 <run id> <rollout seed.nk>
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from rlbus.bus import Bus, BusConnectError, Stage
from rlbus.config import RlbusConfig


async def refused_publish(bus: Bus, subject: str) -> bool:
    """True when the server refused the publish (a permission violation stores nothing, so no ack comes)."""
    try:
        await bus.js.publish(subject, b"probe", timeout=1.0)
    except Exception:  # noqa: BLE001 - a timeout or no-responders: either way nothing was stored
        return True
    return False


async def probe(url: str, run_id: str, rollout_seed: Path) -> list[str]:
    problems = []
    cfg = RlbusConfig(run={"id": run_id}, bus={"url": url, "connect_timeout_s": 3})
    try:
        bus = await Bus.open(cfg, name="anonymous", ensure=False)
    except BusConnectError as exc:
        print(f"anonymous client refused: {exc}")
    else:
        await bus.close()
        problems.append("an anonymous client connected")
    rollout = cfg.model_copy(deep=True)
    rollout.bus.nkeys_seed = rollout_seed
    bus = await Bus.open(rollout, name="auth-probe", ensure=False)
    try:
        # The ready stream exists (a publish the key were allowed would be stored and acked), so a missing
        # ack below is the server's refusal, not an absent stream.
        await bus.js.stream_info(bus.names.stream(Stage.READY))
        if await refused_publish(bus, bus.names.subject(Stage.READY)):
            print("the rollout key's publish to ready was refused")
        else:
            problems.append("the rollout key published a ready group")
    finally:
        await bus.close()
    return problems


def main() -> int:
    url, run_id, seed = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    problems = asyncio.run(probe(url, run_id, seed))
    for p in problems:
        print(f"auth_probe: {p}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
