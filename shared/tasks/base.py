"""The task interface: deterministic example generation and a strict verifier.

A task makes prompts with their reference answers (`make_examples`) and scores a model's response
(`score`). Generation is deterministic in (split, count, seed) and the train and val splits are
disjoint: every problem is assigned to one split by a hash of its prompt, independent of the seed.
"""

from __future__ import annotations

import abc
import hashlib
import random
from dataclasses import dataclass, field

SPLITS = ("train", "val")
# Share of all problems that belong to the val split (by hash of the prompt).
VAL_FRACTION_PERCENT = 10
EOS_TEXTS = ("<eos>", "</s>", "<|endoftext|>", "<|im_end|>")


@dataclass
class Example:
    """One problem: the prompt given to the model, the reference answer, and what the verifier needs."""

    prompt: str
    answer: str
    meta: dict = field(default_factory=dict)


def split_of(key: str) -> str:
    """The split ("train" or "val") a problem belongs to, by a stable hash of its key (its prompt)."""
    h = int.from_bytes(hashlib.sha256(key.encode("utf-8")).digest()[:8], "big")
    return "val" if h % 100 < VAL_FRACTION_PERCENT else "train"


def check_split(split: str) -> str:
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
    return split


def make_rng(task_name: str, split: str, seed: int) -> random.Random:
    """A private RNG for one (task, split, seed); string seeding is stable across runs and platforms."""
    return random.Random(f"rlbus:{task_name}:{split}:{int(seed)}")


def first_line(response: str) -> str:
    """The response up to the first end-of-sequence text or newline, stripped of surrounding spaces."""
    text = response
    for eos in EOS_TEXTS:
        cut = text.find(eos)
        if cut >= 0:
            text = text[:cut]
    return text.split("\n", 1)[0].strip()


class Task(abc.ABC):
    """A task: `make_examples` for data, `score` for rewards (reward, correct)."""

    name: str = "task"
    # A budget hint for generation: enough new tokens for a correct answer plus the end token.
    max_new_tokens: int = 16

    @abc.abstractmethod
    def make_examples(self, split: str, count: int, seed: int = 0) -> list[Example]:
        """`count` examples of `split` ("train" or "val"); the same arguments give the same list."""

    @abc.abstractmethod
    def score(self, response: str, meta: dict) -> tuple[float, bool]:
        """(reward, correct) of a response to the example whose `meta` is given."""

    def _sample_unique(self, split: str, count: int, seed: int, draw) -> list[Example]:
        """Draw examples with `draw(rng)` until `count` of them belong to `split`.

        Problems are unique while the split has enough of them; when it runs out (tiny problem
        spaces), repeats are allowed so that `count` is always honoured.
        """
        check_split(split)
        if count < 0:
            raise ValueError("count must be >= 0")
        rng = make_rng(self.name, split, seed)
        out: list[Example] = []
        seen: set[str] = set()
        misses = 0
        allow_repeats = False
        while len(out) < count:
            ex = draw(rng)
            if split_of(ex.prompt) != split:
                continue
            if ex.prompt in seen and not allow_repeats:
                misses += 1
                if misses > 200 + 20 * count:
                    allow_repeats = True
                continue
            seen.add(ex.prompt)
            out.append(ex)
        return out
