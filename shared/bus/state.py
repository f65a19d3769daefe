"""Small shared facts of a run on a JetStream KV bucket: policy version, weight announcements, heartbeats.

KV (not a work queue) because every reader wants the latest value, and a replica that joins late
must still find it. History 1: only the current value matters.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from nats.aio.client import Client
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import JetStreamContext
from nats.js import api as js_api
from nats.js.errors import BadRequestError, BucketNotFoundError, KeyNotFoundError, NotFoundError
from nats.js.kv import KV_DEL, KV_PURGE, KeyValue

from rlbus import codec
from rlbus.bus.connect import log
from rlbus.bus.disconnects import ConnectionLostError, disconnects_of, unless_disconnected
from rlbus.bus.kv_scan import scan_kv
from rlbus.bus.retry import with_retry
from rlbus.bus.subjects import RunNames
from rlbus.messages import Heartbeat, decode, encode

POLICY_VERSION_KEY = "policy.version"
ANNOUNCE_KEY = "weights.announce"
HEARTBEAT_PREFIX = "hb"
FACT_PREFIX = "fact"
_SCAN_TIMEOUT_S = 5.0
# A scan is an ephemeral consumer; the server reaps one this long after its reader went (nats-py's default is
# 5 min: a learner scanning at every push of a fast run piled up a thousand and hit the consumer limit).
_SCAN_REAP_S = 5.0
# Heartbeats beat every 2 s: a scan younger than this is as good as a new one (and costs the server nothing).
SCAN_REUSE_S = 0.5
T = TypeVar("T")


class RunState:
    """Typed access to the run's KV bucket `rlbus_<run>_state`."""

    def __init__(self, kv: KeyValue, js: JetStreamContext, names: RunNames, nc: Client | None = None) -> None:
        self.kv = kv
        self.js = js  # scans read the bucket's stream through a consumer of their own (rlbus.bus.kv_scan)
        self.names = names
        self.nc = nc  # its disconnects end a request at once (rlbus.bus.disconnects)
        self._scans: dict[str, tuple[float, list[tuple[str, bytes]]]] = {}  # pattern -> (when, result)

    async def _retry(self, what: str, fn: Callable[[], Awaitable[T]]) -> T:
        return await with_retry(what, fn, nc=self.nc)

    @classmethod
    async def open(
        cls,
        js: JetStreamContext,
        names: RunNames,
        storage: str = "file",
        nc: Client | None = None,
        replicas: int = 1,
    ) -> RunState:
        """Bind to the bucket, creating it when missing."""
        bucket = names.state_bucket
        try:
            kv = await js.key_value(bucket)
        except (BucketNotFoundError, NotFoundError):
            st = js_api.StorageType.FILE if storage == "file" else js_api.StorageType.MEMORY
            try:
                kv = await js.create_key_value(
                    js_api.KeyValueConfig(bucket=bucket, history=1, storage=st, replicas=replicas)
                )
            except BadRequestError:  # another service created it a moment ago with other settings
                kv = await js.key_value(bucket)
        return cls(kv, js, names, nc)

    async def _get(self, key: str) -> bytes | None:
        entry = await self._entry(key)
        return entry.value if entry is not None else None

    # ------------------------------------------------------------ policy version

    async def set_policy_version(self, version: int) -> int:
        """Record the learner's current policy version (retried through a reconnect); returns the KV revision."""
        return await self._retry(
            "kv put policy version", lambda: self.kv.put(POLICY_VERSION_KEY, codec.pack(int(version)))
        )

    async def get_policy_version(self, default: int = 0) -> int:
        raw = await self._get(POLICY_VERSION_KEY)
        return int(codec.unpack(raw)) if raw else default

    # ------------------------------------------------------------ weight announcements

    async def put_announcement(self, data: bytes) -> int:
        """Store an encoded WeightAnnouncement (bytes from rlbus.messages.encode), retried through a reconnect."""
        return await self._retry("kv put announcement", lambda: self.kv.put(ANNOUNCE_KEY, data))

    async def get_announcement(self) -> bytes | None:
        return await self._get(ANNOUNCE_KEY)

    async def watch_announcements(
        self, include_current: bool = True, check_every_s: float = 1.0
    ) -> AsyncIterator[bytes]:
        """Yield each new announcement; first the current one when `include_current` (late joiners).

        A KV watch is an ephemeral consumer and dies with a NATS restart. Once the connection it was made on
        drops, the current revision is read as soon as the client is back and the watch is made anew (the
        first announcement after a NATS restart waited a whole `check_every_s` for the replicas before); a
        watch quiet for `check_every_s` is checked the same way. Each revision is yielded at most once.
        """
        last_rev = 0
        if not include_current:
            current = await self._entry(ANNOUNCE_KEY)
            last_rev = current.revision if current is not None and current.revision else 0
        while True:
            dropped = disconnects_of(self.nc).current() if self.nc is not None else None
            try:
                watcher = await self.kv.watch(ANNOUNCE_KEY)
            except Exception as exc:  # reconnecting: try again shortly
                log.debug("bus.watch_retry", key=ANNOUNCE_KEY, error=str(exc))
                await asyncio.sleep(check_every_s)
                continue
            try:
                while True:
                    entry = await _next_update(watcher, self.nc, dropped, check_every_s)
                    if entry is _QUIET or entry is _DROPPED:
                        try:
                            entry = await self._entry(ANNOUNCE_KEY)
                        except Exception as exc:
                            log.debug("bus.watch_check_failed", key=ANNOUNCE_KEY, error=str(exc))
                            break  # make a new watch once the connection is back
                        if entry is not None and (entry.revision or 0) > last_rev and entry.value:
                            log.info("bus.watch_recovered", key=ANNOUNCE_KEY, revision=entry.revision)
                            last_rev = entry.revision or last_rev
                            yield entry.value
                            break  # this watch is stale
                        if dropped is not None and dropped.is_set():
                            break  # made on a connection that is gone: it will never hear again
                        continue
                    if entry is None or entry.operation in (KV_DEL, KV_PURGE) or not entry.value:
                        continue
                    if (entry.revision or 0) <= last_rev:
                        continue
                    last_rev = entry.revision or last_rev
                    yield entry.value
            finally:
                try:
                    await watcher.stop()
                except Exception as exc:  # connection already gone
                    log.debug("bus.watch_stop", error=str(exc))

    async def _entry(self, key: str) -> KeyValue.Entry | None:
        async def get() -> KeyValue.Entry | None:
            try:
                return await self.kv.get(key)
            except (KeyNotFoundError, NotFoundError):
                return None

        return await self._retry(f"kv get {key}", get)

    # ------------------------------------------------------------ heartbeats

    @staticmethod
    def _hb_key(service: str, instance: str) -> str:
        return f"{HEARTBEAT_PREFIX}.{service}.{instance}"

    async def heartbeat(self, hb: Heartbeat) -> int:
        """Publish a service instance's heartbeat under `hb.<service>.<instance>`."""
        self._scans.clear()  # our own writes are seen by our next scan
        return await self.kv.put(self._hb_key(hb.service, hb.instance_id), encode(hb))

    async def _scan(self, pattern: str) -> list[tuple[str, bytes]]:
        """Current (key, value) pairs matching a KV key pattern (retried through a reconnect); a scan of the
        same pattern made less than SCAN_REUSE_S ago is reused."""
        now = time.monotonic()
        cached = self._scans.get(pattern)
        if cached is not None and now - cached[0] < SCAN_REUSE_S:
            return cached[1]
        found = await self._retry(f"kv scan {pattern}", lambda: self._scan_once(pattern))
        self._scans[pattern] = (time.monotonic(), found)
        return found

    async def _scan_once(self, pattern: str) -> list[tuple[str, bytes]]:
        return await scan_kv(self.js, self.names.state_bucket, pattern, _SCAN_TIMEOUT_S, _SCAN_REAP_S)

    async def heartbeats(self, service: str) -> list[Heartbeat]:
        """Every stored heartbeat of a service, however old; undecodable entries are skipped."""
        beats = []
        for key, value in await self._scan(f"{HEARTBEAT_PREFIX}.{service}.>"):
            try:
                hb = decode(value, Heartbeat)
            except Exception as exc:  # one broken writer must not hide the others
                log.warning("bus.bad_heartbeat", key=key, error=str(exc))
                continue
            beats.append(hb)
        return beats

    async def last_beat(self, service: str, instance: str) -> Heartbeat | None:
        """The instance's newest heartbeat, read now (never a reused scan), or None."""
        entry = await self._entry(self._hb_key(service, instance))
        if entry is None or not entry.value:
            return None
        try:
            return decode(entry.value, Heartbeat)
        except Exception as exc:  # a broken writer: nothing to go by
            log.warning("bus.bad_heartbeat", instance=instance, error=str(exc))
            return None

    async def live(self, service: str, max_age_s: float) -> list[Heartbeat]:
        """Instances of `service` whose last heartbeat (by its own timestamp) is at most `max_age_s` old."""
        cutoff = time.time() - max_age_s
        beats = [hb for hb in await self.heartbeats(service) if hb.time >= cutoff]
        return sorted(beats, key=lambda hb: hb.instance_id)

    async def remove(self, service: str, instance: str) -> None:
        """Forget an instance (clean shutdown, or a replica declared dead)."""
        self._scans.clear()
        try:
            await self.kv.purge(self._hb_key(service, instance))
        except (KeyNotFoundError, NotFoundError):
            pass

    # ------------------------------------------------------------ generic facts

    async def put_json(self, key: str, value: Any) -> int:
        """Store a small JSON-able fact under `fact.<key>` (readable with `nats kv get`)."""
        return await self.kv.put(f"{FACT_PREFIX}.{key}", json.dumps(value, sort_keys=True).encode())

    async def get_json(self, key: str, default: Any = None) -> Any:
        raw = await self._get(f"{FACT_PREFIX}.{key}")
        return json.loads(raw) if raw else default


_QUIET = object()  # a watch heard nothing for its check interval
_DROPPED = object()  # the connection a watch was made on dropped


async def _next_update(watcher: Any, nc: Client | None, dropped: asyncio.Event | None, timeout: float) -> Any:
    """The watch's next entry (None: the end of its initial values), `_QUIET` after `timeout` s of
    silence, or `_DROPPED` once the connection the watch was made on (whose event is `dropped`) is gone."""
    if dropped is not None and dropped.is_set():
        return _DROPPED
    try:  # `dropped` not set: the watch's connection is the current one, whose drop ends the wait
        return await unless_disconnected(nc, lambda: watcher.updates(timeout=timeout))
    except ConnectionLostError:
        return _DROPPED
    except NatsTimeoutError:
        return _QUIET
