"""The docs cannot go stale where a test can tell (issue 27).

* MAP.md's "Map" names every module under ``tidegate/``, ``edge/``,
  ``dispatcher/``, ``workers/`` and ``bench/`` and no file that does not exist,
  and its floors are ``FLOORS`` of tests/test_layers.py.
* Every relative link in README.md and docs/**/*.md reaches a file, and a
  ``#anchor`` a heading of that file (GitHub's slugs).
* The README stays short, and its docs index lists every page of docs/.
* ``tidegate.errors.CATALOGUE`` (docs/reference/errors.md) lists every error
  code the product raises.

Standard library only: the Markdown is read line by line, no renderer.
"""

from __future__ import annotations

import ast
import re
import unicodedata
from collections.abc import Iterator
from pathlib import Path

import pytest

from fleet.cli.reference import pages
from tests.test_layers import FLOORS
from tidegate.errors import CATALOGUE

ROOT = Path(__file__).resolve().parents[1]
TOPS = ("tidegate", "edge", "dispatcher", "workers", "fleet", "bench")
PAGES = [ROOT / "README.md", ROOT / "MAP.md", *sorted((ROOT / "docs").rglob("*.md"))]


def prose_lines(text: str) -> Iterator[str]:
    """The lines outside fenced code blocks (``` or ~~~)."""
    fence = ""
    for line in text.splitlines():
        stripped = line.lstrip()
        if fence:
            if stripped.startswith(fence):
                fence = ""
            continue
        if stripped.startswith(("```", "~~~")):
            fence = stripped[:3]
            continue
        yield line


def section(text: str, heading: str) -> list[str]:
    """The prose lines under ``heading`` (a ``## `` line) up to the next ``## ``."""
    lines = list(prose_lines(text))
    start = lines.index(heading) + 1
    end = next((i for i in range(start, len(lines)) if lines[i].startswith("## ")), len(lines))
    return lines[start:end]


# -- the map ---------------------------------------------------------------

MAP = ROOT / "MAP.md"


def map_entries(lines: list[str]) -> dict[str, str]:
    """``{"edge/app.py": "the HTTP surface ...", ...}`` from the Map: each
    ``### `folder/` `` heading, then one ``- `file.py`: what it holds`` line
    per module."""
    entries: dict[str, str] = {}
    folder = None
    for line in lines:
        heading = re.fullmatch(r"### `([\w/]+/)`", line)
        if heading:
            folder = heading.group(1)
            continue
        if line.startswith("### "):
            folder = None
            continue
        item = re.match(r"- `([^`]+)`:?(.*)", line)
        if item and item.group(1).endswith(".py"):
            assert folder is not None, f"Map: {line!r} is under no folder heading"
            entries[folder + item.group(1)] = item.group(2).strip()
    return entries


def source_modules() -> set[str]:
    return {path.relative_to(ROOT).as_posix()
            for top in TOPS for path in (ROOT / top).rglob("*.py")}


def test_the_map_names_every_module_and_only_modules_that_exist() -> None:
    entries = map_entries(section(MAP.read_text(), "## Map"))
    modules = source_modules()
    missing = sorted(modules - entries.keys())
    stale = sorted(entries.keys() - modules)
    report = {"modules MAP.md's Map does not list": missing,
              "Map entries with no such file": stale}
    assert report == {key: [] for key in report}
    empty = sorted(name for name, what in entries.items() if len(what) < 5)
    assert not empty, f"Map entries that do not say what the module holds: {empty}"


def test_the_maps_floors_are_the_layer_tests_floors() -> None:
    floors: dict[str, int] = {}
    for line in section(MAP.read_text(), "## Map"):
        row = re.match(r"\| (\d+) \| ([^|]+) \|", line)
        if row:
            for name in re.findall(r"`([\w.]+)`", row.group(2)):
                floors[name] = int(row.group(1))
    assert floors == FLOORS


def test_map_entries_are_read_the_way_they_are_written() -> None:
    lines = ["### `edge/`", "- `app.py`: the routes", "- not a module",
             "### `workers/backends/`", "- `sse.py`: passthrough", "### Other", "text"]
    assert map_entries(lines) == {"edge/app.py": "the routes",
                                  "workers/backends/sse.py": "passthrough"}


# -- links -----------------------------------------------------------------

LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: the rendered text (code spans and
    links reduced to their text), lower case, with everything but letters,
    digits, spaces, ``-`` and ``_`` dropped and each space a ``-``."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # links -> their text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").strip().lower()
    kept = "".join(c for c in text if c in " -_" or unicodedata.category(c)[0] in "LN")
    return kept.replace(" ", "-")


# The reference pages the docs build generates (fleet.cli.reference): no
# file in the checkout, but a link to one is alive.
GENERATED = {ROOT / "docs" / path: text for path, text in pages().items()}


def text_of(path: Path) -> str:
    return GENERATED[path] if path in GENERATED else path.read_text()


def anchors(path: Path) -> set[str]:
    """Every heading's anchor in ``path``; a repeated slug gets ``-1``, ``-2``..."""
    seen: dict[str, int] = {}
    out = set()
    for line in prose_lines(text_of(path)):
        heading = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not heading:
            continue
        slug = github_slug(heading.group(1))
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        out.add(slug if count == 0 else f"{slug}-{count}")
    return out


def links(path: Path) -> Iterator[str]:
    """The link targets of ``path``'s prose (not code blocks, not code spans),
    paragraph by paragraph: a link's text may wrap onto the next line."""
    for paragraph in "\n".join(prose_lines(path.read_text())).split("\n\n"):
        yield from LINK.findall(re.sub(r"`[^`]*`", "", paragraph))


def broken_links(path: Path) -> list[str]:
    wrong = []
    for target in links(path):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:, ...
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists() and dest not in GENERATED:
            wrong.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            shown = dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest
            wrong.append(f"{target}: no heading #{anchor} in {shown}")
    return wrong


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_resolves(page: Path) -> None:
    assert not broken_links(page), "\n".join(broken_links(page))


def test_the_link_check_catches_a_missing_file_and_a_missing_heading(tmp_path: Path) -> None:
    (tmp_path / "b.md").write_text("# The `[edge]` section: A + B\n\n## Twice\n\n## Twice\n")
    page = tmp_path / "a.md"
    page.write_text("[ok](b.md#the-edge-section-a--b) [ok](b.md#twice-1) [web](https://x.y/z)\n"
                    "[gone](c.md) [bad](b.md#nope) `[code](d.md)` [wrapped\nlink](f.md)\n"
                    "```\n[fenced](e.md)\n```\n[self](#nowhere)\n")
    assert [w.split(": ")[0] for w in broken_links(page)] == ["c.md", "b.md#nope", "f.md",
                                                            "#nowhere"]


# -- the README ------------------------------------------------------------

README = ROOT / "README.md"


def test_the_readme_reads_in_five_minutes() -> None:
    assert len(README.read_text().splitlines()) < 250


def test_the_readmes_docs_index_lists_every_page() -> None:
    index = "\n".join(section(README.read_text(), "## Documentation"))
    listed = {Path(t).name for t in LINK.findall(index) if t.startswith("docs/")}
    pages = {p.name for p in (ROOT / "docs").glob("*.md")}
    assert sorted(pages - listed) == []


# -- errors ----------------------------------------------------------------

# Calls whose positional argument at this index is an error code.
CODE_ARGS = {"ErrorInfo": 2, "_frame_error": 1, "LineError": 0, "_lost": 0}


def raised_codes() -> dict[str, str]:
    """Every error code the product spells out literally: ``code="..."``
    keywords and the code argument of the calls in CODE_ARGS, with where."""
    found: dict[str, str] = {}
    for top in TOPS:
        for path in sorted((ROOT / top).rglob("*.py")):
            if "bench" in path.parts:  # the fake backends' errors are not tidegate's
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if not isinstance(node, ast.Call):
                    continue
                values = [kw.value for kw in node.keywords if kw.arg == "code"]
                name = getattr(node.func, "id", None) or getattr(node.func, "attr", None)
                index = CODE_ARGS.get(name or "")
                if index is not None and len(node.args) > index:
                    values.append(node.args[index])
                for value in values:
                    if isinstance(value, ast.Constant) and isinstance(value.value, str):
                        where = f"{path.relative_to(ROOT)}:{node.lineno}"
                        found.setdefault(value.value, where)
    return found


def test_the_catalogue_lists_every_code_the_product_raises() -> None:
    documented = {code.code for _, codes in CATALOGUE for code in codes}
    codes = raised_codes()
    assert {"invalid_json", "worker_lost", "stream_gap", "backend_error"} <= codes.keys()
    missing = sorted(f"{code} ({where})" for code, where in codes.items()
                     if code not in documented)
    assert not missing, "error codes tidegate.errors.CATALOGUE does not list:\n" + "\n".join(
        missing)
