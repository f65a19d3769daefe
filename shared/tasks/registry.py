"""Tasks by name."""

from __future__ import annotations

from rlbus.tasks.addition import AdditionTask
from rlbus.tasks.base import Task
from rlbus.tasks.countdown import CountdownTask
from rlbus.tasks.gsm8k import Gsm8kTask

TASK_NAMES = ("addition", "countdown", "gsm8k")


def get_task(name: str, digits: int = 2, **kwargs) -> Task:
    """The task called `name`: "addition" and "countdown" take `digits` (operand digits);
    "gsm8k" takes `data_path` among `kwargs`."""
    key = name.strip().lower()
    if key == "addition":
        return AdditionTask(digits=digits)
    if key == "countdown":
        return CountdownTask(digits=digits)
    if key == "gsm8k":
        return Gsm8kTask(**kwargs)
    if key == "math":
        from rlbus.tasks.math import MathTask  # imports math-verify (sympy) only when a run has MATH rows

        return MathTask()
    raise ValueError(f"unknown task {name!r}; known: {', '.join(TASK_NAMES)}")
