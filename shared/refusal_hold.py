"""In a container, a service that refused its configuration stays up, unready, instead of exiting 2.

Docker's and Kubernetes' restart policies cannot exempt an exit code: compose's `on-failure` and a k8s
Deployment restart a refused service again and again, the reason lost among the restarts. With
RLBUS_RUN__ON_REFUSAL=hold (set by rlbus's images) a refusal is printed once, then the process waits for
SIGTERM while serving `/healthz` 200 with the body `refused <service>: <reason>` (so a liveness probe
does not restart it; compose's healthcheck reads the body and shows it unhealthy) and `/readyz` 503.
`rlbus up` and Slurm do not set it: there exit code 2 already stops the run, as intended.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

ON_REFUSAL_ENV = "RLBUS_RUN__ON_REFUSAL"  # run.on_refusal
HEALTH_PORT_ENV = "RLBUS_RUN__HEALTH_PORT"  # read directly: the config that would name it was refused


def holds_on_refusal() -> bool:
    return os.environ.get(ON_REFUSAL_ENV, "exit").strip().lower() == "hold"


def hold_refused(command: str, reason: str, exit_code: int) -> int:
    """Waits for SIGTERM/SIGINT, serving the refusal on the health port; returns `exit_code` then."""
    from rlbus.health import HealthServer

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):  # before saying so: a stop may follow the line at once
        signal.signal(sig, lambda *_: stop.set())
    print(
        f"rlbus {command}: refused (exit {exit_code}): {reason}\n"
        f"rlbus {command}: holding instead of exiting ({ON_REFUSAL_ENV}=hold), so nothing restarts it; "
        "fix the configuration and recreate this container",
        file=sys.stderr,
        flush=True,
    )
    port = int(os.environ.get(HEALTH_PORT_ENV, "0") or 0)
    health = HealthServer(port, command)
    health.set_refused(reason)
    health.start()
    stop.wait()
    health.stop()
    return exit_code
