"""The shape the codebase keeps (issue 16): no module of shared/ or services/ over 500 lines, no function
over 80. A file or function that grows past them is split by role, not waved through."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 80


def _sources() -> list[Path]:
    return sorted(p for folder in ("shared", "services") for p in (ROOT / folder).rglob("*.py"))


def test_no_module_over_500_lines() -> None:
    sources = _sources()
    assert len(sources) > 80  # the walk saw the tree
    long = {
        str(p.relative_to(ROOT)): n
        for p in sources
        if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES
    }
    assert not long, f"split these by role: {long}"


def test_no_function_over_80_lines() -> None:
    long = {}
    for path in _sources():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long[f"{path.relative_to(ROOT)}:{node.name}"] = lines
    assert not long, f"split these: {long}"
