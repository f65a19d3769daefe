"""structlog setup shared by every service: one line per event, key=value (or JSON in containers)."""

from __future__ import annotations

import logging
import sys

import structlog

_SECRET_KEYS = ("password", "token", "secret", "creds", "nkey")


def _redact(_: object, __: str, event: dict) -> dict:
    for key in list(event):
        if any(s in key.lower() for s in _SECRET_KEYS):
            event[key] = "***"
    return event


def setup_logging(level: str = "info", json_logs: bool = False, service: str | None = None) -> None:
    lvl = getattr(logging, level.upper(), logging.INFO)
    logging.basicConfig(level=lvl, stream=sys.stderr, format="%(message)s")
    processors: list = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        # JSON lines go to log collectors: full ISO 8601 UTC to the microsecond; the console's eye wants
        # less, but sub-seconds: a fault's timeline across services (a kill, a redelivery, a rejoin) is
        # a matter of tenths of a second
        structlog.processors.TimeStamper(fmt="iso", utc=True)
        if json_logs
        else structlog.processors.TimeStamper(fmt="%H:%M:%S.%f", utc=False),
        _redact,
    ]
    processors.append(
        structlog.processors.JSONRenderer() if json_logs else structlog.dev.ConsoleRenderer(colors=False)
    )
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
    if service:
        structlog.contextvars.bind_contextvars(service=service)


def get_logger(name: str | None = None) -> structlog.stdlib.BoundLogger:
    return structlog.get_logger(name)
