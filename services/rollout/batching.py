"""How a replica fills a generation batch from the prompt queue.

The learner publishes a step's prompts together, but they reach the server over some milliseconds, and a
JetStream pull answers with what is stored when its first message arrives: one fetch can catch a burst's
first prompt alone. A decode pass costs about the same at 1 row as at 512 (it reads every weight per token
either way), so generating that prompt alone and the rest after it doubled the generation: on an H100 at
64 x 8 x 128 (2026-12-05) it took 0.83 s instead of 0.42 s in 6 of 15 measured steps at async_level=0, and
1.0-1.3 s instead of 0.63-0.83 s in 7 of 15 at async_level=1. A replica that got part of a batch therefore
waits a moment for the rest, bounded by a share of its last pass so that a batch that really is partial
costs little.

A batch is counted in rows (each item's n), up to `rollout.prompts_per_batch` x `rollout.n`: validation work
(n=1) fills it with that many prompts, in one pass, where a count of prompts made it `rollout.n` passes (on an
H100, 2026-12-06, the learning bench's 256 validation prompts took 4 passes of 0.30 s each).
"""

from __future__ import annotations

from rlbus.bus.consumer import Delivery
from rlbus.bus.fan_in import WorkConsumer
from rlbus.messages import PromptWork

LINGER_SHARE = 0.1  # a partial batch waits at most this share of the last generation pass for the rest
LINGER_MAX_S = 0.1
LINGER_MIN_S = 0.02  # below this a pass is cheap enough to run twice
MORE_WAIT_S = 0.05  # a fetch that came back full asks again for what is stored (nats' own floor on a wait)


def linger_after(last_pass_s: float) -> float:
    """How long a partial batch waits for more work after each arrival: 0 where passes are cheap, the most
    before the first pass (whose cost is not known yet). A pull that finds nothing more waits at least 50 ms
    (`Consumer.fetch`'s floor), so that is what a short wait costs."""
    if last_pass_s <= 0:  # no pass yet: the first batch (the evaluation before training) waits the most
        return LINGER_MAX_S
    linger = min(LINGER_SHARE * last_pass_s, LINGER_MAX_S)
    return linger if linger >= LINGER_MIN_S else 0.0


async def fetch_batch(
    consumer: WorkConsumer[PromptWork], rows: int, widest: int, timeout: float, linger_s: float
) -> list[Delivery[PromptWork]]:
    """Work worth up to `rows` generated rows, waiting at most `timeout` s for the first item. Each fetch asks
    for as many items as fit were each `widest` rows (training work's n), so a batch never holds more than
    `rows`; narrower work (validation's n=1) fills the room left in further fetches. A fetch that came back
    full asks again at once; a short one waits `linger_s` for the rest of a burst."""
    asked = max(1, rows // widest)
    got = await consumer.fetch(batch=asked, timeout=timeout)
    last = len(got)
    while got:
        room = (rows - sum(d.message.n for d in got)) // widest
        wait = MORE_WAIT_S if last == asked else linger_s
        if room < 1 or wait <= 0:
            break
        asked = room
        more = await consumer.fetch(batch=asked, timeout=wait)
        if not more:
            break
        got += more
        last = len(more)
    return got
