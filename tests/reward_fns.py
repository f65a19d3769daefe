"""User reward functions for tests, imported by path ('reward_fns:...') inside the reward sandbox."""

from __future__ import annotations

import time


def double_score(prompt: str, response: str, meta: dict) -> tuple[float, bool]:
    """Like the addition verifier but pays 2.0: lets a test see which implementation scored a sample."""
    ok = response.strip() == str(meta.get("answer"))
    return (2.0 if ok else 0.0), ok


def always_raises(prompt: str, response: str, meta: dict) -> float:
    raise RuntimeError("user code is broken")


def sleeps(prompt: str, response: str, meta: dict) -> float:
    time.sleep(30)
    return 1.0


def hogs_memory(prompt: str, response: str, meta: dict) -> float:
    blob = bytearray(2 * 1024**3)  # over the sandbox's memory limit
    return float(len(blob))
