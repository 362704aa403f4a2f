"""Module docstrings stay short: what the module is, its invariant, a link to
the docs, in 15 lines or fewer (STYLE.md 16). Essays, measurements and history
belong in docs/, CHANGELOG.md and commit messages.

Counted as lines of source, opening and closing quotes included.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("tidegate", "edge", "dispatcher", "workers", "fleet", "bench")
MAX_LINES = 15


def docstring_lines(source: str) -> int:
    """How many source lines the module docstring of ``source`` spans (0: none)."""
    body = ast.parse(source).body
    if not body or not isinstance(body[0], ast.Expr):
        return 0
    node = body[0]
    if not (isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)):
        return 0
    return (node.end_lineno or node.lineno) - node.lineno + 1


def test_the_count_is_of_source_lines_quotes_included() -> None:
    assert docstring_lines('"""One line."""\nx = 1\n') == 1
    assert docstring_lines('"""Title.\n\nBody.\n"""\n') == 4
    assert docstring_lines("x = 1\n") == 0
    assert docstring_lines("# a comment\n'''Single quotes.'''\n") == 1


def test_no_module_docstring_is_over_15_lines() -> None:
    long = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            lines = docstring_lines(path.read_text())
            if lines > MAX_LINES:
                long[path.relative_to(ROOT).as_posix()] = lines
    assert long == {}, f"module docstrings over {MAX_LINES} lines: {long}"
