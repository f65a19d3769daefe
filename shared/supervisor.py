"""When `rlbus up` restarts a service that died, as compose's `restart: on-failure` would.

A service that exits non-zero is started again after a backoff that doubles with each quick death in a
row (capped) and starts over once the service had run STABLE_RUN_S, as Docker's restart policy does; up
to `run.max_restarts` restarts in all; the learner too (it resumes from its last checkpoint). Past the
cap the run stops with one clear message instead of restarting forever. A service that refused its
configuration (`EXIT_REFUSED`), or a learner whose weight push kept failing for one reason
(`EXIT_PUSH_FAILED`), is never restarted: it would stop the same way again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from rlbus.service import EXIT_PUSH_FAILED, EXIT_REFUSED

STABLE_RUN_S = 10.0  # Docker's: a container that ran this long restarts after the first delay again


class Action(Enum):
    NOTHING = "nothing"  # running, finished cleanly, or waiting out its backoff
    RESTART = "restart"
    REFUSED = "refused"  # stop the run: its configuration cannot work
    STOP = "stop"  # stop the run with this code: it stopped for a reason a restart would repeat
    GIVE_UP = "give_up"  # stop the run: it kept dying


@dataclass
class Supervisor:
    max_restarts: int
    backoff_s: float = 1.0
    max_backoff_s: float = 30.0
    restarts: dict[str, int] = field(default_factory=dict)
    due: dict[str, float] = field(default_factory=dict)  # name -> when its pending restart may happen
    quick_deaths: dict[str, int] = field(default_factory=dict)  # name -> deaths in a row before STABLE_RUN_S

    def on_exit(self, name: str, rc: int | None, now: float, started_at: float | None = None) -> Action:
        """What to do about service `name`, seen with exit code `rc` (None = still running) at time `now`;
        `started_at` is when this process of it started (None: unknown, counted as a quick death)."""
        if rc is None or rc == 0:
            self.due.pop(name, None)
            return Action.NOTHING
        if rc == EXIT_REFUSED:
            return Action.REFUSED
        if rc == EXIT_PUSH_FAILED:
            return Action.STOP
        done = self.restarts.get(name, 0)
        if done >= self.max_restarts:
            return Action.GIVE_UP
        if name not in self.due:
            stable = started_at is not None and now - started_at >= STABLE_RUN_S
            streak = 0 if stable else self.quick_deaths.get(name, 0)
            self.quick_deaths[name] = streak + 1
            self.due[name] = now + min(self.max_backoff_s, self.backoff_s * 2**streak)
        if now < self.due[name]:
            return Action.NOTHING
        del self.due[name]
        self.restarts[name] = done + 1
        return Action.RESTART
