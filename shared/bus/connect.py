"""One way to open a NATS connection: auth and TLS from the config, reconnect forever, no secrets in logs.

A service must survive a NATS restart, so after the first connection the client retries forever
with capped exponential backoff; the first connection itself waits at most `wait_s`, then fails
with an error that names the (redacted) URL.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import ssl
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from nats.aio.client import Client
from nats.errors import AuthorizationError

from rlbus.bus.disconnects import disconnects_of
from rlbus.config.schema import BusConfig

try:
    import structlog

    log: Any = structlog.get_logger("rlbus.bus")
except ImportError:  # pragma: no cover - structlog is a dependency
    import logging

    log = logging.getLogger("rlbus.bus")

RECONNECT_BASE_S = 0.1
RECONNECT_CAP_S = 0.5  # a server back after an outage is found within half a second (jittered: no storm)
PENDING_BUFFER_BYTES = 64 * 1024 * 1024
"""Client-side buffer for publishes made while reconnecting; large enough for a few 8 MiB messages."""


class BusConnectError(ConnectionError):
    """No connection could be made; the message names the redacted URL and the last error."""


def redact_url(url: str) -> str:
    """`nats://user:secret@host:4222` -> `nats://user:***@host:4222`; a bare token becomes `***`."""
    parts = []
    for one in url.split(","):
        try:
            split = urlsplit(one.strip())
        except ValueError:
            parts.append("<unparseable url>")
            continue
        if split.username is None and split.password is None:
            parts.append(one.strip())
            continue
        host = split.hostname or ""
        if split.port is not None:
            host = f"{host}:{split.port}"
        user = "***" if split.password is None else f"{split.username}:***"
        parts.append(urlunsplit((split.scheme, f"{user}@{host}", split.path, split.query, split.fragment)))
    return ",".join(parts)


def _safe_error(exc: BaseException | None, secrets: list[str]) -> str:
    text = f"{type(exc).__name__}: {exc}" if exc is not None else "unknown error"
    for secret in secrets:
        if secret:
            text = text.replace(secret, "***")
    return text


def _tls_context(cfg: BusConfig) -> ssl.SSLContext | None:
    if not (cfg.tls_ca or cfg.tls_cert or cfg.tls_key):
        return None
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(cfg.tls_ca) if cfg.tls_ca else None)
    if cfg.tls_cert:
        ctx.load_cert_chain(str(cfg.tls_cert), str(cfg.tls_key) if cfg.tls_key else None)
    elif cfg.tls_key:
        raise BusConnectError("bus.tls_key is set without bus.tls_cert")
    return ctx


def _auth_options(cfg: BusConfig) -> dict[str, Any]:
    opts: dict[str, Any] = {}
    if cfg.user is not None:
        opts["user"] = cfg.user
        opts["password"] = cfg.password or ""
    elif cfg.password is not None:
        raise BusConnectError("bus.password is set without bus.user")
    if cfg.token is not None:
        opts["token"] = cfg.token
    if cfg.creds_file is not None or cfg.nkeys_seed is not None:
        try:
            import nkeys  # noqa: F401
        except ImportError as exc:
            raise BusConnectError(
                "bus.creds_file / bus.nkeys_seed need the `nkeys` package (pip install nkeys)"
            ) from exc
        if cfg.creds_file is not None:
            if not cfg.creds_file.is_file():
                raise BusConnectError(f"bus.creds_file {cfg.creds_file} does not exist")
            opts["user_credentials"] = str(cfg.creds_file)
        if cfg.nkeys_seed is not None:
            if not cfg.nkeys_seed.is_file():
                raise BusConnectError(f"bus.nkeys_seed {cfg.nkeys_seed} does not exist")
            opts["nkeys_seed"] = str(cfg.nkeys_seed)
    return opts


def _backoff_handler(servers: list[Any], info: dict[str, Any]) -> tuple[Any, float]:
    """nats-py hook called on every reconnect attempt: the server tried least so far (a dead cluster member
    is passed over for the live ones; nats-py itself would take the list's first every time), after a
    capped exponential backoff with jitter."""
    least = min(servers, key=lambda s: s.reconnects, default=None)
    attempts = least.reconnects if least is not None else 0
    delay = min(RECONNECT_CAP_S, RECONNECT_BASE_S * (2 ** min(attempts, 10)))
    return least, delay * (0.5 + random.random() / 2)


def _secrets(cfg: BusConfig, url: str) -> list[str]:
    """What must never appear in a log line: the configured password and token, and the URL's."""
    secrets = [s for s in (cfg.password, cfg.token) if s]
    split = urlsplit(url.split(",")[0].strip())
    if split.password:
        secrets.append(split.password)
    elif split.username and split.scheme:
        secrets.append(split.username)  # nats://<token>@host: the user part is the token
    return secrets


async def connect(cfg: BusConfig, url: str, name: str, wait_s: float = 30.0) -> Client:
    """Connected client for `url` (comma-separated for a cluster). Raises BusConnectError after `wait_s`."""
    safe_url = redact_url(url)
    secrets = _secrets(cfg, url)
    tls = _tls_context(cfg)
    auth = _auth_options(cfg)
    state: dict[str, Any] = {"connected": False, "last_error": None}
    auth_failed = asyncio.Event()

    async def on_error(exc: Exception) -> None:
        state["last_error"] = exc
        if not state["connected"]:
            # nats-py reports a refused CONNECT as a plain Error('Authorization Violation').
            if isinstance(exc, AuthorizationError) or "authorization violation" in str(exc).lower():
                auth_failed.set()
            return  # the first-connection loop below reports the final error once
        log.warning("bus.error", name=name, url=safe_url, error=_safe_error(exc, secrets))

    async def on_disconnect() -> None:
        disconnects_of(nc).fire()  # requests in flight on the dropped connection are retried now
        if state["connected"] and not nc.is_closed:  # a close() of our own is not news
            log.warning("bus.disconnected", name=name, url=safe_url)

    async def on_reconnect() -> None:
        disconnects_of(nc).reconnected()
        log.info(
            "bus.reconnected",
            name=name,
            url=safe_url,
            server=redact_url(nc.connected_url.geturl() if nc.connected_url else ""),
        )

    async def on_closed() -> None:
        if state["connected"]:
            # the connection's traffic, for telling a chatty protocol from a slow one
            stats = {k: nc.stats.get(k, 0) for k in ("in_msgs", "out_msgs", "in_bytes", "out_bytes")}
            log.info("bus.closed", name=name, url=safe_url, **stats)

    nc = Client()
    servers = [u.strip() for u in url.split(",") if u.strip()]
    task = asyncio.ensure_future(
        nc.connect(
            servers=servers,
            name=name,
            connect_timeout=cfg.connect_timeout_s,  # type: ignore[arg-type]
            allow_reconnect=True,
            max_reconnect_attempts=-1,
            reconnect_time_wait=0.25,  # type: ignore[arg-type]  # pause between first-connection tries
            reconnect_to_server_handler=_backoff_handler,
            pending_size=PENDING_BUFFER_BYTES,
            tls=tls,
            error_cb=on_error,
            disconnected_cb=on_disconnect,
            reconnected_cb=on_reconnect,
            closed_cb=on_closed,
            **auth,
        )
    )
    auth_wait = asyncio.ensure_future(auth_failed.wait())
    try:
        done, _ = await asyncio.wait({task, auth_wait}, timeout=wait_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        auth_wait.cancel()
    if task in done and task.exception() is None:
        state["connected"] = True
        log.info("bus.connected", name=name, url=safe_url, max_payload=nc.max_payload)
        return nc
    if task in done:
        state["last_error"] = task.exception()
    else:
        task.cancel()
        with contextlib.suppress(Exception, asyncio.CancelledError):
            await task
    with contextlib.suppress(Exception):
        await nc.close()
    why = "authorization failed" if auth_failed.is_set() else f"no answer within {wait_s:.0f}s"
    error = _safe_error(state["last_error"], secrets)
    log.error("bus.connect_failed", name=name, url=safe_url, reason=why, error=error)
    raise BusConnectError(f"cannot connect to NATS at {safe_url}: {why} ({error})")


__all__ = ["BusConnectError", "Client", "connect", "redact_url"]
