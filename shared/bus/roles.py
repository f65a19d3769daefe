"""One NATS user per service process, each allowed to publish only what its role publishes.

The bus is the trust boundary of a run: any client that can publish to `ready` can train the policy on what it
likes, and any that can write a heartbeat or an announcement can steer the weight push. So every process of a
run `rlbus up` starts gets its own user on the server rlbus starts, with publish permissions cut to its role:

- rollout publishes trajectories, its own heartbeat key, weight acks and answers to the learner's roll calls;
- reward publishes scored groups (or ready ones when no ref runs), ref publishes ready ones;
- the learner publishes prompts, weight announcements, roll calls and the run's facts, and owns the streams;
- the reader (status, the CLI) publishes only JetStream read requests.

Each may acknowledge, fetch from and dead-letter only its own input stage. Everyone may subscribe to what the
run carries. Pure: `role_permissions` and `authorization_block` build the server's configuration.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from rlbus.bus.state import HEARTBEAT_PREFIX
from rlbus.bus.subjects import RunNames, Stage

Role = Literal["learner", "rollout", "reward", "ref", "reader"]
INPUT_STAGE: dict[str, Stage] = {
    "rollout": Stage.PROMPTS,
    "reward": Stage.TRAJECTORIES,
    "ref": Stage.SCORED,
    "learner": Stage.READY,
}
READER_FILE = "reader.json"  # beside the server's config: the read-only user `rlbus status` connects as

_READ_API = [
    "$JS.API.INFO",
    "$JS.API.STREAM.INFO.>",
    "$JS.API.STREAM.NAMES",
    "$JS.API.STREAM.LIST",
    "$JS.API.CONSUMER.INFO.>",
    "$JS.API.CONSUMER.LIST.>",
    "$JS.API.DIRECT.GET.>",
    "$JS.API.STREAM.MSG.GET.>",
    "$JS.FC.>",
]


@dataclass(frozen=True)
class RoleUser:
    """A user of the run's NATS server: the process it is for, its role and its password."""

    user: str
    role: Role
    password: str
    instance: str = ""  # the service instance id whose heartbeat key it may write


def role_permissions(role: Role, names: RunNames, instance: str = "", needs_ref: bool = True) -> dict:
    """The NATS `permissions` block of one user: publish allow (and deny) lists, subscribe to anything."""
    state, blobs = names.state_bucket, names.blobs_bucket
    if role == "learner":
        others = [
            *names.subjects(Stage.TRAJECTORIES),
            *names.subjects(Stage.SCORED),
            *names.subjects(Stage.READY),
        ]
        foreign_beats = [f"$KV.{state}.{HEARTBEAT_PREFIX}.{svc}.>" for svc in ("rollout", "reward", "ref")]
        return {"publish": {"allow": [">"], "deny": [*others, *foreign_beats]}, "subscribe": {"allow": [">"]}}
    if role == "reader":
        consumers = f"$JS.API.CONSUMER.CREATE.KV_{state}.>"  # a KV scan is an ephemeral consumer
        return {
            "publish": {"allow": [*_READ_API, consumers, f"$JS.API.CONSUMER.CREATE.KV_{state}"]},
            "subscribe": {"allow": [">"]},
        }
    sources = names.streams(INPUT_STAGE[role])
    outputs = {
        "rollout": [*names.subjects(Stage.TRAJECTORIES), names.weight_ack],
        "reward": names.subjects(Stage.SCORED if needs_ref else Stage.READY),
        "ref": names.subjects(Stage.READY),
    }[role]
    allow = [
        *_READ_API,
        "$JS.API.STREAM.CREATE.>",  # ensure: creating what exists with the same setup is a no-op
        "$JS.API.CONSUMER.CREATE.>",
        "$JS.API.CONSUMER.DURABLE.CREATE.>",
        *(f"$JS.API.CONSUMER.MSG.NEXT.{source}.>" for source in sources),  # fetch from its own input only
        *(f"$JS.ACK.{source}.>" for source in sources),  # and acknowledge only that
        f"$JS.API.STREAM.PURGE.OBJ_{blobs}",  # a consumed claim-checked payload is deleted
        f"$O.{blobs}.>",  # a large output goes by claim check
        names.dlq_subject(INPUT_STAGE[role]),
        f"$KV.{state}.{HEARTBEAT_PREFIX}.{role}.{instance or '*'}",
        *outputs,
    ]
    perms: dict = {"publish": {"allow": allow}, "subscribe": {"allow": [">"]}}
    if role == "rollout":
        perms["allow_responses"] = True  # answers to roll calls go to the caller's inbox
    return perms


def make_users(names: RunNames, instances: dict[str, Role]) -> list[RoleUser]:
    """One user per service instance (instance id -> role), plus the reader; fresh random passwords."""
    users = [
        RoleUser(user=f"rlbus-{instance}", role=role, password=secrets.token_urlsafe(24), instance=instance)
        for instance, role in sorted(instances.items())
    ]
    users.append(RoleUser(user="rlbus-reader", role="reader", password=secrets.token_urlsafe(24)))
    return users


def authorization_block(users: list[RoleUser], names: RunNames, needs_ref: bool) -> str:
    """The server configuration's `authorization {}` block (JSON is valid NATS configuration syntax)."""
    entries = [
        {
            "user": u.user,
            "password": u.password,
            "permissions": role_permissions(u.role, names, u.instance, needs_ref),
        }
        for u in users
    ]
    return "authorization " + json.dumps({"users": entries}, indent=1)


def nkey_authorization_block(public_keys: dict[Role, str], names: RunNames, needs_ref: bool) -> str:
    """The `authorization {}` block of a stack whose processes share one NKey per role (compose): the
    server holds only public keys, and a role's rights do not depend on which replica connects."""
    entries = [
        {"nkey": key, "permissions": role_permissions(role, names, "", needs_ref)}
        for role, key in sorted(public_keys.items())
    ]
    return "authorization " + json.dumps({"users": entries}, indent=1)


def write_reader(users: list[RoleUser], folder: Path) -> Path:
    """The reader's credentials, readable only by their owner, for `rlbus status` on this run."""
    reader = next(u for u in users if u.role == "reader")
    path = folder / READER_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch(mode=0o600)
    path.write_text(json.dumps({"user": reader.user, "password": reader.password}))
    path.chmod(0o600)
    return path


def read_reader(folder: Path) -> tuple[str, str] | None:
    """(user, password) of the run's reader, when the run's server has roles."""
    try:
        raw = json.loads((folder / READER_FILE).read_text())
        return str(raw["user"]), str(raw["password"])
    except (OSError, ValueError, KeyError):
        return None
