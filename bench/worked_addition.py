"""The learning benchmark's task: long addition with its column steps written out, scored on the final line.

A problem is two operands of `min_digits`..`max_digits` digits, asked as the user turn "48213+7396" of a chat.
The answer works right to left, one line per column with its carry in and its digit sum, then the result:

    3+6+0=9
    1+9+0=10
    ...
    #### 55609

so a correct answer takes 8-12 tokens a column (64-140 tokens for 6-12 digits on the character tokenizer),
and one slip in any column makes the result wrong: accuracy rises smoothly with skill, not in one jump.

`compute_score` has verl's signature, so the same file is rlbus's `custom_reward_function.path` and the
reward TRL's GRPOTrainer calls: one verifier for both systems.
"""

from __future__ import annotations

import random
import re

from rlbus.tasks.base import Example, Task

DATA_SOURCE = "rlbus/worked_addition"
# A chat template of our own tokenizer's characters: the user turn, then the assistant's cue.
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:\n{% endif %}"
)
_RESULT = re.compile(r"####\s*(-?\d+)")


def worked_answer(a: int, b: int) -> str:
    """The column steps of a+b, right to left (carry in, digit sum), then `#### a+b`."""
    xs, ys = str(a)[::-1], str(b)[::-1]
    lines, carry = [], 0
    for i in range(max(len(xs), len(ys))):
        x = int(xs[i]) if i < len(xs) else 0
        y = int(ys[i]) if i < len(ys) else 0
        total = x + y + carry
        lines.append(f"{x}+{y}+{carry}={total}")
        carry = total // 10
    return "\n".join([*lines, f"#### {a + b}"])


def compute_score(
    data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None
) -> float:
    """1.0 when the first `#### N` line of the response gives the sum, else 0.0 (verl's signature)."""
    found = _RESULT.search(solution_str)
    return 1.0 if found is not None and found.group(1) == str(ground_truth).strip() else 0.0


class WorkedAddition(Task):
    """a+b of `min_digits`..`max_digits` digits each; train and val problems are disjoint (by prompt hash)."""

    name = "worked_addition"

    def __init__(self, min_digits: int = 6, max_digits: int = 10) -> None:
        if not 1 <= min_digits <= max_digits:
            raise ValueError("need 1 <= min_digits <= max_digits")
        self.min_digits, self.max_digits = min_digits, max_digits
        self.max_new_tokens = 12 * (max_digits + 1) + 16  # every column line, the result and the end token

    def _draw(self, rng: random.Random) -> Example:
        def operand() -> int:
            digits = rng.randint(self.min_digits, self.max_digits)
            return rng.randint(10 ** (digits - 1), 10**digits - 1)

        a, b = operand(), operand()
        return Example(prompt=f"{a}+{b}", answer=worked_answer(a, b), meta={"ground_truth": str(a + b)})

    def make_examples(self, split: str, count: int, seed: int = 0) -> list[Example]:
        return self._sample_unique(split, count, seed, self._draw)

    def score(self, response: str, meta: dict) -> tuple[float, bool]:
        reward = compute_score(DATA_SOURCE, response, meta["ground_truth"])
        return reward, reward == 1.0


def rendered(tokenizer, examples: list) -> list:
    """The examples with their prompts as the chat template renders them for generation (as both systems do)."""
    return [
        Example(
            prompt=tokenizer.apply_chat_template(
                [{"role": "user", "content": ex.prompt}], tokenize=False, add_generation_prompt=True
            ),
            answer=ex.answer,
            meta=ex.meta,
        )
        for ex in examples
    ]


def verl_rows(examples: list[Example], split: str) -> list[dict]:
    """The rows of a parquet in verl's schema (what examples/data_preprocess/gsm8k.py writes)."""
    return [
        {
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": ex.prompt}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": ex.meta["ground_truth"]},
            "extra_info": {"split": split, "index": i},
        }
        for i, ex in enumerate(examples)
    ]
