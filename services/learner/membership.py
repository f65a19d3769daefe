"""Who is in the next weight group: membership by evidence, not by heartbeat.

A heartbeat in the run's KV says a replica claims to be alive; anyone with the bus can write one (a forged
beat, or the last beat of a replica SIGKILLed seconds ago). A replica enters a weight group only after it
answers that group's roll call (rlbus.messages.JoinCall) within `trainer.weight_join_window_s`. A replica
that stayed silent, missed a rendezvous or broke a push is a suspect: it is called again only after a
backoff that doubles with each strike (or once at once when a new process took its id), and it is cleared
only by a push it took part in. Suspects live in the run's KV, so a new learner attempt starts from them.

Everything here is pure: the pusher asks `plan_push` what to do and tells `after_roll_call` /
`after_failure` / `after_success` what happened.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

MAX_BACKOFF_S = 600.0
EAGER_PROBES = 2  # a new process under a suspect's id is called at once this many strikes long


@dataclass(frozen=True)
class Suspect:
    """A replica id that failed to earn its place: silent at a roll call, absent at a rendezvous, or in a
    group that broke."""

    incarnation: str  # the process that failed
    strikes: int  # failures since it last took part in a good push
    retry_at: float  # wall time before which it is not called again (unless a new process took its id)
    reason: str = ""

    def to_dict(self) -> dict:
        return {
            "incarnation": self.incarnation,
            "strikes": self.strikes,
            "retry_at": self.retry_at,
            "reason": self.reason,
        }

    @classmethod
    def from_dict(cls, raw: Mapping) -> Suspect:
        return cls(
            str(raw["incarnation"]), int(raw["strikes"]), float(raw["retry_at"]), str(raw.get("reason", ""))
        )


@dataclass(frozen=True)
class PushPlan:
    """What the next push does about membership."""

    keep: bool  # the live, unsuspected replicas are exactly the last good push's members: no roll call
    call: tuple[str, ...]  # replica ids to call to the roll (empty when keep)
    probes: tuple[str, ...]  # of those, suspects given another chance


def backoff_s(strikes: int, base_s: float) -> float:
    """How long a suspect with `strikes` waits before it is called again: base, 2x base, 4x base, ..."""
    return min(MAX_BACKOFF_S, base_s * 2 ** max(strikes - 1, 0))


def _may_call(suspect: Suspect, incarnation: str, now: float) -> bool:
    """A suspect is called again once its backoff is over, or at once when a new process holds its id (a
    restarted replica) while its strikes are few (a forger changing incarnations is not called each time)."""
    if now >= suspect.retry_at:
        return True
    return incarnation != suspect.incarnation and suspect.strikes <= EAGER_PROBES


def plan_push(
    live: Mapping[str, str],
    suspects: Mapping[str, Suspect],
    last_members: Mapping[str, str] | None,
    now: float,
) -> PushPlan:
    """`live`: replica id -> incarnation of every fresh, ready heartbeat; `last_members`: the same for the last
    good push (None when the next push must form a new group whatever the members)."""
    trusted = {rid: inc for rid, inc in live.items() if rid not in suspects}
    probes = tuple(
        sorted(rid for rid, inc in live.items() if rid in suspects and _may_call(suspects[rid], inc, now))
    )
    if last_members is not None and not probes and trusted == dict(last_members):
        return PushPlan(keep=True, call=(), probes=())
    return PushPlan(keep=False, call=tuple(sorted({*trusted, *probes})), probes=probes)


def after_roll_call(
    plan: PushPlan,
    live: Mapping[str, str],
    answered: Mapping[str, str],
    suspects: Mapping[str, Suspect],
    now: float,
    base_s: float,
) -> tuple[dict[str, str], dict[str, Suspect]]:
    """(members, suspects): who answered as the process its heartbeat names joins; who did not is (again) a
    suspect, with one more strike and a longer backoff. An answering suspect stays on the list (strikes kept)
    until a push it takes part in succeeds."""
    members: dict[str, str] = {}
    out = dict(suspects)
    for rid in plan.call:
        inc = live[rid]
        if answered.get(rid) == inc:
            members[rid] = inc
            continue
        strikes = out[rid].strikes + 1 if rid in out else 1
        out[rid] = Suspect(inc, strikes, now + backoff_s(strikes, base_s), "silent at the roll call")
    return members, out


def after_failure(
    members: Mapping[str, str],
    to_blame: Iterable[str] | None,
    suspects: Mapping[str, Suspect],
    now: float,
    base_s: float,
    reason: str,
) -> dict[str, Suspect]:
    """A push to `members` failed. `to_blame`: the members known to have caused it (absent at the
    rendezvous, silent after an IPC read): one more strike each. None: it cannot be told who (a broadcast
    broke): every member is called to the next roll at once, where the live ones answer."""
    out = dict(suspects)
    if to_blame is None:
        for rid, inc in members.items():
            strikes = out[rid].strikes if rid in out else 0
            out[rid] = Suspect(inc, strikes, now, reason)
        return out
    for rid in to_blame:
        if rid not in members:
            continue
        strikes = out[rid].strikes + 1 if rid in out else 1
        out[rid] = Suspect(members[rid], strikes, now + backoff_s(strikes, base_s), reason)
    return out


def after_success(members: Iterable[str], suspects: Mapping[str, Suspect]) -> dict[str, Suspect]:
    """A push reached `members`: they are cleared."""
    gone = set(members)
    return {rid: s for rid, s in suspects.items() if rid not in gone}


def forget_absent(live: Iterable[str], suspects: Mapping[str, Suspect], now: float) -> dict[str, Suspect]:
    """Suspects whose heartbeat is gone and whose backoff is over are forgotten (the list stays small)."""
    alive = set(live)
    return {rid: s for rid, s in suspects.items() if rid in alive or now < s.retry_at}
