"""Per-role NKeys for a stack whose NATS server rlbus does not start itself (compose's one-shot service).

`rlbus bus-credentials --into DIR` writes `DIR/<role>/seed.nk` for each role (kept when present, so a
second `up` does not lock out running services) and `DIR/server/auth.conf`, the server's authorization
block with the public keys and each role's permissions for the run in the config (rewritten every time:
the run id and whether a ref stage runs decide the subjects). Compose mounts each role's folder into that
role's containers only, and the server folder into NATS.
"""

from __future__ import annotations

import os
from pathlib import Path

import nkeys

from rlbus.bus.roles import Role, nkey_authorization_block
from rlbus.bus.subjects import RunNames

STACK_ROLES: tuple[Role, ...] = ("learner", "rollout", "reward", "ref", "reader")
SEED_FILE = "seed.nk"
SERVER_DIR = "server"
AUTH_FILE = "auth.conf"


def ensure_seed(path: Path) -> str:
    """The public key of the user seed at `path`, made (readable by its owner only) when absent."""
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        seed = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as out:
            out.write(seed)
    return nkeys.from_seed(bytearray(path.read_bytes().strip())).public_key.decode()


def write_stack_credentials(into: Path, names: RunNames, needs_ref: bool) -> Path:
    """Seeds for every role (made once) and the server's auth.conf (made every time); returns auth.conf."""
    keys = {role: ensure_seed(into / role / SEED_FILE) for role in STACK_ROLES}
    auth = into / SERVER_DIR / AUTH_FILE
    auth.parent.mkdir(parents=True, exist_ok=True)
    tmp = auth.with_suffix(".tmp")
    tmp.write_text(nkey_authorization_block(keys, names, needs_ref) + "\n")
    tmp.chmod(0o644)  # public keys only; the NATS container may run as another user
    tmp.replace(auth)
    return auth
