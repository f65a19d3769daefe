"""GSM8K-style verifier: the final number of a response against the reference number.

The data comes from the user's JSONL files (GSM8K's own format: {"question": ..., "answer": "...
#### 42"}); nothing is downloaded. The answer of a response is read as verl reads it (`reward.gsm8k_method`):
strict (verl's default) takes the number after the last `#### `, flexible the last number; `any` takes
the last `\\boxed{...}`, else the number after the last `####`, else the last number, compared as numbers.
"""

from __future__ import annotations

import json
import random
import re
from fractions import Fraction
from pathlib import Path

from rlbus.tasks.base import Example, Task, check_split, split_of

_NUMBER = r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+"
_NUMBER_RE = re.compile(_NUMBER)
_HASHES_RE = re.compile(r"####\s*\$?\s*(" + _NUMBER + ")")
_BOXED = "\\boxed{"
_FRAC_RE = re.compile(r"\\d?frac\{\s*(-?\d+)\s*\}\{\s*(-?\d+)\s*\}")


def _last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...}, with nested braces balanced; None if none closes."""
    start = text.rfind(_BOXED)
    while start >= 0:
        depth, i = 1, start + len(_BOXED)
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth == 0:
            return text[start + len(_BOXED) : i - 1]
        start = text.rfind(_BOXED, 0, start)
    return None


def to_number(text: str) -> Fraction | None:
    """A number written as in GSM8K ("1,234", "$5", "3.50", "-2", "7/2"), or None."""
    if text is None:
        return None
    s = text.strip().replace(",", "").replace("$", "").replace(" ", "").rstrip(".")
    s = s.removeprefix("\\$")
    if s.endswith("%"):
        s = s[:-1]
    try:
        if "/" in s:
            num, den = s.split("/", 1)
            return Fraction(int(num), int(den))
        return Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None


def extract_answer(text: str) -> str | None:
    """The final answer text of a response (boxed, then '####', then the last number), or None."""
    if not text:
        return None
    boxed = _last_boxed(text)
    if boxed is not None:
        boxed = _FRAC_RE.sub(r"\1/\2", boxed)
        nums = _NUMBER_RE.findall(boxed)
        if to_number(boxed) is not None:
            return boxed.strip()
        return nums[-1] if nums else boxed.strip()
    hashes = _HASHES_RE.findall(text)
    if hashes:
        return hashes[-1]
    nums = _NUMBER_RE.findall(text)
    return nums[-1] if nums else None


SOLUTION_CLIP_CHARS = 300  # verl reads only the last 300 characters (regexes on long text are slow)
_VERL_STRICT_RE = re.compile(r"#### (\-?[0-9\.\,]+)")
_VERL_NUMBER_RE = re.compile(r"(\-?[0-9\.\,]+)")


def verl_extract(text: str, method: str) -> str | None:
    """verl's gsm8k.extract_solution: 'strict' takes the number after the last '#### ', 'flexible' the
    last number (not a lone '.'), both from the last 300 characters, with ',' and '$' removed."""
    text = text[-SOLUTION_CLIP_CHARS:]
    if method == "strict":
        found = _VERL_STRICT_RE.findall(text)
        return found[-1].replace(",", "").replace("$", "") if found else None
    for candidate in reversed(_VERL_NUMBER_RE.findall(text)):
        if candidate not in ("", "."):
            return candidate
    return None


def answers_match(predicted: str | None, reference: str) -> bool:
    a, b = to_number(predicted) if predicted is not None else None, to_number(reference)
    if a is None or b is None:
        return predicted is not None and predicted.strip() == str(reference).strip()
    return a == b


def load_jsonl(path: str | Path) -> list[dict]:
    rows = []
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            line = line.strip()
            if line:
                rows.append(json.loads(line))
    return rows


class Gsm8kTask(Task):
    """Verifier for GSM8K-format data; `make_examples` reads the user's JSONL (`data_path`)."""

    name = "gsm8k"
    max_new_tokens = 512

    def __init__(
        self,
        data_path: str | Path | None = None,
        prompt_suffix: str = "",
        method: str = "strict",
        format_score: float = 0.0,
    ):
        self.data_path = data_path
        self.prompt_suffix = prompt_suffix
        self.method = method  # strict, flexible (verl's) or any (boxed, '####', last number)
        self.format_score = format_score

    def example_from_record(self, row: dict) -> Example:
        question = row.get("question") or row.get("prompt") or row.get("problem")
        if question is None:
            raise ValueError(f"record has no question/prompt field: {sorted(row)}")
        raw = str(row.get("answer", row.get("solution", "")))
        final = extract_answer(raw) if "####" in raw or "\\boxed" in raw else raw.strip()
        answer = final if final is not None else raw.strip()
        return Example(
            prompt=str(question) + self.prompt_suffix,
            answer=answer,
            meta={"task": self.name, "answer": answer},
        )

    def make_examples(self, split: str, count: int, seed: int = 0) -> list[Example]:
        """Examples of `split` from `data_path`: problems are split by a hash of the question."""
        check_split(split)
        if self.data_path is None:
            raise ValueError("the gsm8k task needs data: give data_path (GSM8K-format JSONL)")
        examples = [self.example_from_record(r) for r in load_jsonl(self.data_path)]
        examples = [ex for ex in examples if split_of(ex.prompt) == split]
        random.Random(f"rlbus:{self.name}:{split}:{int(seed)}").shuffle(examples)
        return examples[:count]

    def score(self, response: str, meta: dict) -> tuple[float, bool]:
        """verl's compute_score in its modes: 1.0 when the answer equals the reference, format_score when one
        was found but differs, 0 when none; `any` compares numerically whatever the answer's spelling."""
        if self.method == "any":
            correct = answers_match(extract_answer(response), str(meta["answer"]))
            return (1.0 if correct else 0.0), correct
        answer = verl_extract(response, self.method)
        if answer is None:
            return 0.0, False
        correct = answer == str(meta["answer"])
        return (1.0 if correct else self.format_score), correct
