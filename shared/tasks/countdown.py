"""Countdown: reach a target from three numbers with + - * (each number used once).

The answer is an arithmetic expression such as "(3+5)*7". The verifier never calls eval: the
response is checked against a character whitelist and a length limit, parsed with `ast`, and
walked by our own evaluator, which accepts only integer literals, + - * and parentheses.
"""

from __future__ import annotations

import ast
import random
from collections import Counter

from rlbus.tasks.base import Example, Task, first_line

ALLOWED_CHARS = frozenset("0123456789+-*() ")
MAX_EXPRESSION_CHARS = 64
_OPS = ("+", "-", "*")
_FORMS = ("{x}{o1}{y}{o2}{z}", "({x}{o1}{y}){o2}{z}", "{x}{o1}({y}{o2}{z})")


class UnsafeExpression(ValueError):
    """The text is not an expression of integer literals, + - * and parentheses."""


def _eval_node(node: ast.AST, literals: list[int]) -> int:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        literals.append(node.value)
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in (ast.Add, ast.Sub, ast.Mult):
        left = _eval_node(node.left, literals)
        right = _eval_node(node.right, literals)
        if isinstance(node.op, ast.Add):
            return left + right
        if isinstance(node.op, ast.Sub):
            return left - right
        return left * right
    raise UnsafeExpression(f"disallowed syntax: {type(node).__name__}")


def parse_expression(text: str) -> tuple[int, list[int]]:
    """(value, integer literals in order) of a + - * ( ) expression; raises UnsafeExpression.

    Nothing in `text` is ever executed: characters outside digits, + - * ( ) and space are refused
    before parsing, and the syntax tree is evaluated by hand.
    """
    if not isinstance(text, str):
        raise UnsafeExpression("not a string")
    expr = text.strip()
    if not expr:
        raise UnsafeExpression("empty expression")
    if len(expr) > MAX_EXPRESSION_CHARS:
        raise UnsafeExpression("expression too long")
    bad = set(expr) - ALLOWED_CHARS
    if bad:
        raise UnsafeExpression(f"disallowed characters: {''.join(sorted(bad))!r}")
    try:
        tree = ast.parse(expr, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
        raise UnsafeExpression(f"not an expression: {exc}") from None
    literals: list[int] = []
    value = _eval_node(tree.body, literals)
    return value, literals


class CountdownTask(Task):
    """Three numbers of 1..10**digits-1 and a target built from them with + - *."""

    name = "countdown"

    def __init__(self, digits: int = 1):
        if digits < 1:
            raise ValueError("digits must be >= 1")
        self.digits = int(digits)
        self.low, self.high = 1, 10**self.digits - 1
        self.max_new_tokens = 3 * self.digits + 2 + 2 + 1

    @staticmethod
    def format_prompt(numbers: list[int], target: int) -> str:
        return f"use {' '.join(str(n) for n in numbers)} to make {target}:"

    def example(self, numbers: list[int], target: int, answer: str) -> Example:
        return Example(
            prompt=self.format_prompt(numbers, target),
            answer=answer,
            meta={"task": self.name, "numbers": list(numbers), "target": target, "answer": answer},
        )

    def _draw(self, rng: random.Random) -> Example:
        while True:
            numbers = [rng.randint(self.low, self.high) for _ in range(3)]
            x, y, z = rng.sample(numbers, 3)
            form = rng.choice(_FORMS)
            answer = form.format(x=x, y=y, z=z, o1=rng.choice(_OPS), o2=rng.choice(_OPS))
            target, _ = parse_expression(answer)
            if target >= 1:
                return self.example(numbers, target, answer)

    def make_examples(self, split: str, count: int, seed: int = 0) -> list[Example]:
        return self._sample_unique(split, count, seed, self._draw)

    def score(self, response: str, meta: dict) -> tuple[float, bool]:
        try:
            value, literals = parse_expression(first_line(response))
        except UnsafeExpression:
            return 0.0, False
        numbers = [int(n) for n in meta["numbers"]]
        correct = Counter(literals) == Counter(numbers) and value == int(meta["target"])
        return (1.0 if correct else 0.0), correct
