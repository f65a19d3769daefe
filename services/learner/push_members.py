"""The learner's side of weight-group membership: asks rlbus.learner.membership what to do, calls the roll,
keeps the suspect list, and stores it in the run's KV so a new learner attempt starts from it."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterable, Mapping

from rlbus.bus import Stage
from rlbus.bus.hand_back import ROLLOUT_DURABLE, hand_back, ours_to_hand_back
from rlbus.bus.roll_call import is_gone, roll_call
from rlbus.learner.membership import (
    PushPlan,
    Suspect,
    after_failure,
    after_roll_call,
    after_success,
    forget_absent,
    plan_push,
)
from rlbus.service import ServiceContext

SUSPECTS_FACT = "weights.suspects"  # the run's KV: a new learner attempt starts from the last one's suspects


class PushMembership:
    """Who takes the next push: the last push's members when nothing changed, else those that answer a roll
    call within `join_window_s`. Silent or failing replicas are suspects, called again after a backoff that
    starts at `backoff_base_s` (the push timeout: one suspect costs at most about half the run's pushes
    nothing, and its next chance costs one join window)."""

    def __init__(self, ctx: ServiceContext, join_window_s: float, backoff_base_s: float) -> None:
        self.ctx = ctx
        self.join_window_s = join_window_s
        self.backoff_base_s = backoff_base_s
        self.suspects: dict[str, Suspect] = {}
        self.roll_calls = 0  # roll calls made (each waits at most join_window_s)
        self.handed_back = 0  # deliveries of gone replicas sent back to the queue
        self._handing_back: set[asyncio.Task] = set()

    async def load(self) -> None:
        """The suspects an earlier learner attempt of this run left in the KV."""
        raw = await self.ctx.state.get_json(SUSPECTS_FACT, {})
        try:
            self.suspects = {rid: Suspect.from_dict(v) for rid, v in (raw or {}).items()}
        except (KeyError, TypeError, ValueError) as exc:  # a broken record: start clean
            self.ctx.log.warning("unreadable suspect list; starting without it", error=str(exc))
        if self.suspects:
            self.ctx.log.info("replica suspects of an earlier attempt", suspects=sorted(self.suspects))

    def plan(self, live: Mapping[str, str], last: Mapping[str, str] | None) -> PushPlan:
        """The pure decision for `live` (replica id -> incarnation) against the last push's members."""
        now = time.time()
        self.suspects = forget_absent(live, self.suspects, now)
        return plan_push(live, self.suspects, last, now)

    async def admit(self, live: Mapping[str, str], last: Mapping[str, str] | None) -> dict[str, str]:
        """The members of the next push (replica id -> incarnation)."""
        plan = self.plan(live, last)
        if plan.keep:
            return dict(last or {})
        bus = self.ctx.bus
        answered = await roll_call(bus.nc, bus.names, plan.call, self.join_window_s, self.ctx.log)
        self.roll_calls += 1
        members, suspects = after_roll_call(
            plan, live, answered, self.suspects, time.time(), self.backoff_base_s
        )
        await self._store(suspects)
        return members

    async def failed(self, members: Mapping[str, str], to_blame: Iterable[str] | None, reason: str) -> None:
        """A push to `members` failed; `to_blame` get a strike (None: it cannot be told who, and every member
        is called to the next roll, where the live ones answer)."""
        now = time.time()
        await self._store(after_failure(members, to_blame, self.suspects, now, self.backoff_base_s, reason))
        blamed = members if to_blame is None else {rid: members.get(rid, "") for rid in to_blame}
        task = asyncio.create_task(self._hand_back_if_gone(blamed))  # beside the next push, not before it
        self._handing_back.add(task)
        task.add_done_callback(self._handing_back.discard)

    async def _hand_back_if_gone(self, members: Mapping[str, str]) -> None:
        """Each of `members` (replica id -> the incarnation that failed) whose process is gone: the work its
        last beat named goes back on the queue now, not after the stage's ack wait (rlbus.bus.hand_back)."""
        bus = self.ctx.bus
        with contextlib.suppress(Exception):  # best effort: the ack wait still hands the work back
            gone = await asyncio.gather(*(is_gone(bus.nc, bus.names, rid) for rid in members))
            if not any(gone):
                return
            for rid, is_dead in zip(members, gone, strict=True):
                beat = await self.ctx.state.last_beat("rollout", rid) if is_dead else None
                if beat is None or (members[rid] and beat.incarnation != members[rid]):
                    continue  # alive, never beat, or a new process under its id (its beat names its own work)
                subjects = ours_to_hand_back(beat.holding, bus.names.streams(Stage.PROMPTS), ROLLOUT_DURABLE)
                sent = await hand_back(bus.nc, subjects)
                self.handed_back += sent
                if sent:
                    self.ctx.log.info("work a gone replica held handed back", replica=rid, naks=sent)

    async def succeeded(self, members: Iterable[str]) -> None:
        await self._store(after_success(members, self.suspects))

    async def _store(self, suspects: dict[str, Suspect]) -> None:
        """Take the new list: say who is new on it (or has one more strike), store it when it changed."""
        if suspects == self.suspects:
            return
        for rid, s in sorted(suspects.items()):
            old = self.suspects.get(rid)
            if old is None or old.strikes < s.strikes:
                self.ctx.log.warning(
                    "replica suspected; it joins again only by answering a roll call",
                    replica=rid,
                    strikes=s.strikes,
                    next_call_in_s=round(max(s.retry_at - time.time(), 0.0), 1),
                    reason=s.reason,
                )
        self.suspects = suspects
        try:
            await self.ctx.state.put_json(SUSPECTS_FACT, {rid: s.to_dict() for rid, s in suspects.items()})
        except Exception as exc:  # noqa: BLE001 - kept in memory; the next change stores it again
            self.ctx.log.warning("suspect list not stored", error=str(exc))
