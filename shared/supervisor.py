"""When `rlbus up` restarts a service that died, as compose's `restart: on-failure` would.

A service that exits non-zero is started again after a backoff that doubles with each of its restarts
(capped), up to `run.max_restarts` times; the learner too (it resumes from its last checkpoint). Past the
cap the run stops with one clear message instead of restarting forever. A service that refused its
configuration (`EXIT_REFUSED`), or a learner whose weight push kept failing for one reason
(`EXIT_PUSH_FAILED`), is never restarted: it would stop the same way again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from rlbus.service import EXIT_PUSH_FAILED, EXIT_REFUSED


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

    def on_exit(self, name: str, rc: int | None, now: float) -> Action:
        """What to do about service `name`, seen with exit code `rc` (None = still running) at time `now`."""
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
            self.due[name] = now + min(self.max_backoff_s, self.backoff_s * 2**done)
        if now < self.due[name]:
            return Action.NOTHING
        del self.due[name]
        self.restarts[name] = done + 1
        return Action.RESTART
