"""Multi-digit addition: prompt "37+45=", answer "82"."""

from __future__ import annotations

import random

from rlbus.tasks.base import Example, Task, first_line


class AdditionTask(Task):
    """a+b with both operands of exactly `digits` digits (0-9 for one digit)."""

    name = "addition"

    def __init__(self, digits: int = 2):
        if digits < 1:
            raise ValueError("digits must be >= 1")
        self.digits = int(digits)
        self.low = 0 if self.digits == 1 else 10 ** (self.digits - 1)
        self.high = 10**self.digits - 1
        # answer has at most digits+1 characters, plus the end token
        self.max_new_tokens = self.digits + 2

    def example(self, a: int, b: int) -> Example:
        answer = str(a + b)
        return Example(
            prompt=f"{a}+{b}=",
            answer=answer,
            meta={"task": self.name, "a": a, "b": b, "answer": answer},
        )

    def _draw(self, rng: random.Random) -> Example:
        return self.example(rng.randint(self.low, self.high), rng.randint(self.low, self.high))

    def make_examples(self, split: str, count: int, seed: int = 0) -> list[Example]:
        return self._sample_unique(split, count, seed, self._draw)

    def score(self, response: str, meta: dict) -> tuple[float, bool]:
        answer = meta.get("answer")
        if answer is None:
            answer = str(int(meta["a"]) + int(meta["b"]))
        correct = first_line(response) == str(answer)
        return (1.0 if correct else 0.0), correct
