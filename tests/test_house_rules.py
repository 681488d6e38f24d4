"""The house's size rules, read from the sources of psworker/ (nothing imported): no module over 400 lines, no
function over 60, no line over 120 columns. Where one is broken, split on a natural seam (docs/architecture.md)."""

from __future__ import annotations

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "psworker"
MAX_MODULE_LINES, MAX_FUNCTION_LINES, MAX_COLUMNS = 400, 60, 120


def _sources() -> dict[str, str]:
    return {str(p.relative_to(PACKAGE.parent)): p.read_text() for p in sorted(PACKAGE.rglob("*.py"))}


def test_no_module_over_400_lines():
    long = {name: n for name, text in _sources().items() if (n := len(text.splitlines())) > MAX_MODULE_LINES}
    assert not long, long


def test_no_function_over_60_lines():
    long = {}
    for name, text in _sources().items():
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long[f"{name}:{node.lineno} {node.name}"] = lines
    assert not long, long


def test_no_line_over_120_columns():
    wide = [f"{name}:{i}" for name, text in _sources().items() for i, line in enumerate(text.splitlines(), 1)
            if len(line) > MAX_COLUMNS]
    assert not wide, wide
