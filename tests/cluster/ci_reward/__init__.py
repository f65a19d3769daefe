"""The user-function scorer `make test-compose` swaps in mid-run: the addition verifier, but it pays 2.0
for a right answer, so the learner's metrics show from the outside which implementation scored a batch
(reward/mean = 2 x reward/accuracy once it is in)."""

from __future__ import annotations


def score(prompt: str, response: str, meta: dict) -> tuple[float, bool]:
    ok = response.strip() == str(meta.get("answer"))
    return (2.0 if ok else 0.0), ok
