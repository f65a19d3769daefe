"""MATH-style verifier: a response's final (boxed) answer against the reference, compared symbolically.

Used for verl data_sources such as lighteval/MATH, MATH-500, AIME or DAPO-math. Parsing and equivalence are
HuggingFace's math-verify (LaTeX, fractions, sets, intervals, units of formatting), not our own regexes.
Nothing is generated here: the data comes from the user's files.
"""

from __future__ import annotations

import logging
import threading

from rlbus.tasks.base import Example, Task

logging.getLogger("math_verify").setLevel(logging.ERROR)  # it warns on every call made without a timeout
_TIMEOUT_S = 5


def _timeout() -> int | None:
    """math-verify times out with SIGALRM, which only the main thread may use."""
    return _TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


def math_equal(response: str, reference: str) -> bool:
    """Whether the response's final answer equals the reference (which may be bare or in $...$/\\boxed{})."""
    from math_verify import parse, verify

    ref = reference.strip()
    if "\\boxed" not in ref and not ref.startswith("$"):
        ref = f"${ref}$"
    gold = parse(ref, parsing_timeout=_timeout())
    pred = parse(response, parsing_timeout=_timeout())
    if not gold or not pred:
        return False
    return bool(verify(gold, pred, timeout_seconds=_timeout()))


class MathTask(Task):
    name = "math"

    def make_examples(self, split: str, count: int, seed: int = 0) -> list[Example]:
        raise ValueError("the math verifier scores rows of your data files (data.train_files); it makes none")

    def score(self, response: str, meta: dict) -> tuple[float, bool]:
        correct = math_equal(response, str(meta["answer"]))
        return (1.0 if correct else 0.0), correct
