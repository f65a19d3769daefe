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


def sleeps_on_request(prompt: str, response: str, meta: dict) -> tuple[float, bool]:
    """double_score, but a response of "slow" never returns in time: the others of its group must still score."""
    if response.strip() == "slow":
        time.sleep(30)
    return double_score(prompt, response, meta)


def hogs_memory(prompt: str, response: str, meta: dict) -> float:
    blob = bytearray(2 * 1024**3)  # over the sandbox's memory limit
    return float(len(blob))


def batch_compute_score(data_sources, solution_strs, ground_truths, extra_infos):
    """verl's batch reward manager signature: lists in, one score per response out."""
    assert len(data_sources) == len(solution_strs) == len(ground_truths) == len(extra_infos)
    return [
        {"score": float(s.strip() == str(g)), "acc": s.strip() == str(g)} if d == "openai/gsm8k" else -1.0
        for d, s, g in zip(data_sources, solution_strs, ground_truths, strict=True)
    ]


def batch_wrong_length(data_sources, solution_strs, ground_truths, extra_infos):
    return [0.0]


def two_arguments(prompt: str, response: str) -> float:
    """A function written for another framework: it cannot take our (prompt, response, meta)."""
    return 1.0


def returns_nothing(prompt: str, response: str, meta: dict) -> None:
    """Forgot its return statement."""


def verl_style_missing_ground_truth(data_source, solution_str):
    return 0.0


def flaky_addition(prompt: str, response: str, meta: dict) -> tuple[float, bool]:
    """The addition verifier, but it raises on about 10% of its inputs (which ones depends on the text only)."""
    import zlib

    if zlib.crc32(f"{prompt}|{response}".encode()) % 10 == 0:
        raise RuntimeError("flaky reward function")
    ok = response.strip() == str(meta.get("answer"))
    return float(ok), ok
