"""The error a service's log names first since its last start, for the console: a user should not have to
open the log to learn why a service refused to start or kept dying."""

from __future__ import annotations

import json
import re
from pathlib import Path

TAIL_BYTES = 256 * 1024
START_MARK = "service started"  # the line every service logs once connected (rlbus.service)
MAX_CHARS = 400
_EXCEPTION_LINE = re.compile(r"^([A-Za-z_][\w.]*(Error|Exception|Refused|Exit)\w*)(: .*)?$")
# structlog's console renderer: `05:09:23 [error    ] event text   key=value reason="..."`
_CONSOLE_ERROR = re.compile(r"^(?:\S+\s+)*?\[(error|critical)\s*\]\s+(?P<rest>.*)$")
_FIRST_FIELD = re.compile(r"\s+\w+=")
_DETAIL_FIELD = re.compile(r'\b(?:error|reason)=("(?:[^"\\]|\\.)*"|\S+)')


def first_error(log_path: Path) -> str:
    """The first error of the service's last start (the cause; what follows is often its consequence): a
    log line at level error/critical, JSON or console-rendered (its event and its error or reason), or the
    line that ends a traceback (`SomethingError: why`); '' when there is none."""
    try:
        with log_path.open("rb") as f:
            f.seek(max(0, f.seek(0, 2) - TAIL_BYTES))
            lines = f.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return ""
    starts = [i for i, line in enumerate(lines) if START_MARK in line]
    for line in lines[starts[-1] if starts else 0 :]:
        if reason := _error_of(line.strip()):
            return reason
    return ""


def _error_of(text: str) -> str:
    """What one log line says went wrong, or '' when it is not an error line."""
    if text.startswith("{"):
        try:
            entry = json.loads(text)
        except ValueError:
            return ""
        if isinstance(entry, dict) and entry.get("level") in ("error", "critical"):
            detail = entry.get("error") or entry.get("reason") or ""
            return _short(f"{entry.get('event', '')}: {detail}" if detail else str(entry.get("event", "")))
        return ""
    if match := _CONSOLE_ERROR.match(text):
        rest = match.group("rest")
        event = _FIRST_FIELD.split(rest, maxsplit=1)[0].strip()
        field = _DETAIL_FIELD.search(rest[len(event) :])
        detail = field.group(1).strip('"').replace('\\"', '"') if field else ""
        return _short(f"{event}: {detail}" if detail else event)
    if _EXCEPTION_LINE.match(text):
        return _short(text)
    return ""


def _short(text: str) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= MAX_CHARS else flat[: MAX_CHARS - 3] + "..."
