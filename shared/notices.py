"""One-line notices a service wants on the operator's console (why it waits, why it stopped).

Services append to `<run dir>/notices.jsonl`; `rlbus up` prints new lines under its progress lines. Logs
hold the detail; a notice is the sentence a user must not have to dig for.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

NOTICES_FILE = "notices.jsonl"


def post_notice(run_dir: Path, service: str, text: str) -> None:
    """Append one notice (best effort: the console is a convenience, the log has it too)."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        with open(run_dir / NOTICES_FILE, "a", encoding="utf-8") as f:
            f.write(json.dumps({"time": time.time(), "service": service, "text": text}) + "\n")
    except OSError:
        pass


def read_notices(run_dir: Path, offset: int = 0) -> tuple[list[dict], int]:
    """Notices appended since byte `offset`, and the offset to read from next (whole lines only)."""
    path = run_dir / NOTICES_FILE
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read()
    except OSError:
        return [], offset
    end = data.rfind(b"\n") + 1
    rows = []
    for line in data[:end].splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue
    return rows, offset + end
