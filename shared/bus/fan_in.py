"""One stage's partitions behind one `fetch()`: a service serves every partition of its input.

Each partition is a pull consumer of its own (the same durable name on each partition's stream, so replicas
of a service still share the work). `fetch` keeps one long-poll open per partition and hands out whatever
arrives first, so an idle partition never delays a busy one. A poll that returns after `fetch` did keeps its
deliveries for the next `fetch` (at most `batch` per partition are held that way), and tells the server they
are in progress every third of their ack wait until they are handed out, so a replica busy generating does
not lose them to a redelivery.
"""

from __future__ import annotations

import asyncio
import time
from typing import Generic

from rlbus.bus.connect import log
from rlbus.bus.consumer import Consumer, Delivery, M

POLL_S = 1.0  # one long-poll's wait on an empty partition


class FanInConsumer(Generic[M]):
    """The consumers of one stage's partitions, fetched from as one."""

    def __init__(self, parts: list[Consumer[M]]) -> None:
        if not parts:
            raise ValueError("a fan-in needs at least one partition")
        self.parts = parts
        self.stage = parts[0].stage
        self.durable = parts[0].durable
        self._ready: list[Delivery[M]] = []
        self._arrived = asyncio.Event()
        self._polls: dict[int, asyncio.Task[None]] = {}
        self._keepalive: asyncio.Task[None] | None = None

    @property
    def dead_letters(self) -> int:
        return sum(p.dead_letters for p in self.parts)

    async def fetch(self, batch: int = 1, timeout: float = 5.0) -> list[Delivery[M]]:
        """Up to `batch` valid deliveries from any partition, waiting at most `timeout` s for the first."""
        deadline = time.monotonic() + timeout
        while not self._ready:
            self._poll_idle_partitions(batch)
            left = deadline - time.monotonic()
            if left <= 0:
                break
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), timeout=left)
            except TimeoutError:
                break
        out, self._ready = self._ready[:batch], self._ready[batch:]
        return out

    def _poll_idle_partitions(self, batch: int) -> None:
        for k, part in enumerate(self.parts):
            poll = self._polls.get(k)
            if poll is None or poll.done():
                self._polls[k] = asyncio.ensure_future(self._poll(part, batch))

    async def _poll(self, part: Consumer[M], batch: int) -> None:
        try:
            got = await part.fetch(batch=batch, timeout=POLL_S)
        except Exception as exc:  # noqa: BLE001 - a partition that fails now is polled again next fetch
            log.warning(
                "bus.fan_in_poll_failed", stage=self.stage.value, error=f"{type(exc).__name__}: {exc}"
            )
            return
        if got:
            self._ready.extend(got)
            self._arrived.set()
            if self._keepalive is None or self._keepalive.done():
                self._keepalive = asyncio.ensure_future(self._keep_alive())

    async def _keep_alive(self) -> None:
        """While deliveries wait to be handed out, restart their ack wait clocks every third of it."""
        every = min(p.ack_wait_s for p in self.parts) / 3
        while self._ready:
            await asyncio.sleep(every)
            for delivery in list(self._ready):
                try:
                    await delivery.in_progress()
                except Exception as exc:  # noqa: BLE001 - the server away: redelivery is the fallback
                    log.debug("bus.fan_in_keepalive_failed", stage=self.stage.value, error=str(exc))

    async def pending(self) -> int:
        """Items waiting in every partition plus items handed out but not yet acked."""
        return sum([await p.pending() for p in self.parts])

    async def close(self) -> None:
        """Stop polling; deliveries fetched but not handed out go back to their queues at once."""
        polls, self._polls = list(self._polls.values()), {}
        if self._keepalive is not None:
            polls.append(self._keepalive)
        for poll in polls:
            poll.cancel()
        await asyncio.gather(*polls, return_exceptions=True)
        held, self._ready = self._ready, []
        for delivery in held:
            try:
                await delivery.nak()
            except Exception as exc:  # noqa: BLE001 - unreachable: it comes back after its ack wait
                log.debug("bus.fan_in_return_failed", stage=self.stage.value, error=str(exc))
        for part in self.parts:
            await part.close()


WorkConsumer = Consumer[M] | FanInConsumer[M]
"""What `Bus.consumer` hands out: one partition's consumer, or the fan-in over several (`WorkConsumer[M]`:
of a stage whose messages are `M`)."""
