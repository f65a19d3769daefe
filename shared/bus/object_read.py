"""Reading a claim-checked payload back from the Object Store at the speed of the server, not of a push
consumer.

nats-py's `ObjectStore.get` creates an ordered push consumer per object and appends each chunk to a bytes
object: 18 MB/s on loopback for a 9.5 MB group (issue 30's measurement). The chunks of an object are
messages on one subject of the bucket's stream, so they are read here with direct gets, each the next
message on that subject (any replica of a clustered stream may answer), joined once and checked against
the object's SHA-256 digest as nats-py checks it (bench/claim_check.py measures both side by side).
"""

from __future__ import annotations

import base64
from hashlib import sha256

from nats.js.client import JetStreamContext
from nats.js.object_store import ObjectStore

DIGEST_PREFIX = "SHA-256="


class ObjectDigestMismatch(ValueError):
    """The chunks read back do not hash to the digest the object was stored with."""


async def read_object(js: JetStreamContext, obs: ObjectStore, bucket: str, name: str) -> bytes:
    """The whole object `name` of `bucket` (ObjectNotFoundError when there is none)."""
    info = await obs.get_info(name)
    if not info.size:
        return b""
    stream, subject = f"OBJ_{bucket}", f"$O.{bucket}.C.{info.nuid}"
    parts: list[bytes] = []
    seq = 1
    for _ in range(int(info.chunks or 0)):
        msg = await js.get_msg(stream, seq=seq, subject=subject, next=True, direct=True)
        parts.append(msg.data or b"")
        seq = int(msg.seq or seq) + 1
    data = b"".join(parts)
    digest = str(info.digest or "")
    if digest.upper().startswith(DIGEST_PREFIX):
        want = base64.urlsafe_b64decode(digest[len(DIGEST_PREFIX) :])
        if sha256(data).digest() != want:
            raise ObjectDigestMismatch(
                f"object {name!r} of {bucket}: {len(data)} bytes read do not match its digest"
            )
    if len(data) != int(info.size):
        raise ObjectDigestMismatch(f"object {name!r} of {bucket}: read {len(data)} bytes of {info.size}")
    return data
