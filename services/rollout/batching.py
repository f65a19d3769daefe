"""How a replica fills a generation batch from the prompt queue.

The learner publishes a step's prompts together, but they reach the server over some milliseconds, and a
JetStream pull answers with what is stored when its first message arrives: one fetch can catch a burst's
first prompt alone. A decode pass costs about the same at 1 row as at 512 (it reads every weight per token
either way), so generating that prompt alone and the rest after it doubled the generation: on an H100 at
64 x 8 x 128 (2026-12-05) it took 0.83 s instead of 0.42 s in 6 of 15 measured steps at async_level=0, and
1.0-1.3 s instead of 0.63-0.83 s in 7 of 15 at async_level=1. A replica that got part of a batch therefore
waits a moment for the rest, bounded by a share of its last pass so that a batch that really is partial
costs little.
"""

from __future__ import annotations

from rlbus.bus.consumer import Delivery, M
from rlbus.bus.fan_in import WorkConsumer

LINGER_SHARE = 0.1  # a partial batch waits at most this share of the last generation pass for the rest
LINGER_MAX_S = 0.1
LINGER_MIN_S = 0.02  # below this a pass is cheap enough to run twice


def linger_after(last_pass_s: float) -> float:
    """How long a partial batch waits for more work after each arrival: 0 where passes are cheap. A pull that
    finds nothing more waits at least 50 ms (`Consumer.fetch`'s floor), so that is what a short wait costs."""
    linger = min(LINGER_SHARE * last_pass_s, LINGER_MAX_S)
    return linger if linger >= LINGER_MIN_S else 0.0


async def fetch_batch(
    consumer: WorkConsumer[M], batch: int, timeout: float, linger_s: float
) -> list[Delivery[M]]:
    """Up to `batch` deliveries, waiting at most `timeout` s for the first; while the batch is short, more
    that arrive within `linger_s` of the last join it."""
    got = await consumer.fetch(batch=batch, timeout=timeout)
    while got and linger_s > 0 and len(got) < batch:
        more = await consumer.fetch(batch=batch - len(got), timeout=linger_s)
        if not more:
            break
        got += more
    return got
