"""The README's two commands, as a user copies them: the quick start's run
command and its test command (the one-line fenced blocks of "## Quick start"
that install the checkout and then start ``tidegate up`` / run pytest).

Standard library only: ``.ci/run`` calls it with a bare ``python3`` before
anything is installed, to run the test command verbatim::

    python3 tests/readme.py test    # prints the test command
    python3 tests/readme.py run     # prints the run command

tests/test_readme.py runs both in a fresh directory, so the README cannot
drift from what works.
"""

from __future__ import annotations

import sys
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def quick_start_commands(text: str | None = None) -> dict[str, str]:
    """``{"run": ..., "test": ...}`` from the README's Quick start section."""
    text = README.read_text() if text is None else text
    section = text.split("\n## Quick start\n", 1)[1].split("\n## ", 1)[0]
    commands = [block[0] for block in _fenced_blocks(section)
                if len(block) == 1 and "pip install" in block[0]]
    found = {"run": [c for c in commands if c.endswith("tidegate up")],
             "test": [c for c in commands if c.endswith("python -m pytest")]}
    if any(len(v) != 1 for v in found.values()):
        raise ValueError(f"README Quick start: want one run and one test command, "
                         f"found {found}")
    return {name: values[0] for name, values in found.items()}


def _fenced_blocks(text: str) -> list[list[str]]:
    """The lines of each fenced code block (any info string), in order."""
    blocks: list[list[str]] = []
    current: list[str] | None = None
    for line in text.splitlines():
        if line.startswith("```"):
            if current is None:
                current = []
            else:
                blocks.append([x.strip() for x in current if x.strip()])
                current = None
        elif current is not None:
            current.append(line)
    return blocks


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] not in ("run", "test"):
        sys.exit("usage: python3 tests/readme.py run|test")
    print(quick_start_commands()[sys.argv[1]])
