"""Synthetic tasks and verifiers: addition, countdown, GSM8K."""

from rlbus.tasks.addition import AdditionTask
from rlbus.tasks.base import Example, Task, first_line, split_of
from rlbus.tasks.countdown import CountdownTask, UnsafeExpression, parse_expression
from rlbus.tasks.gsm8k import Gsm8kTask, extract_answer
from rlbus.tasks.registry import TASK_NAMES, get_task

__all__ = [
    "TASK_NAMES",
    "AdditionTask",
    "CountdownTask",
    "Example",
    "Gsm8kTask",
    "Task",
    "UnsafeExpression",
    "extract_answer",
    "first_line",
    "get_task",
    "parse_expression",
    "split_of",
]
