"""The docs site: ``mkdocs build --strict`` passes with no warning (every page
in the nav, every link and anchor alive), and the reference it generates from
the code (fleet.cli.reference) describes every config key, error code,
metric and command.

The build tests skip only where mkdocs is not installed (the dev extra has
it), and fail instead under ``CI=true``: CI must build the site.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fleet.cli import build_parser, reference
from tests.readme import quick_start_commands
from tidegate.config import schema
from tidegate.errors import CATALOGUE, Code

ROOT = Path(__file__).resolve().parents[1]


def build(root: Path, site: Path) -> tuple[int, str]:
    """``mkdocs build --strict`` of the site at ``root``: its exit code and output."""
    if importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("material") is None:
        if os.environ.get("CI") == "true":
            pytest.fail("mkdocs-material is not installed: pip install -e '.[dev]'")
        pytest.skip("mkdocs-material is not installed (pip install -e '.[dev]')")
    # NO_MKDOCS_2_WARNING: Material's banner about its successor, printed at
    # every build; it is about Material's future, not about these docs.
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
         str(root / "mkdocs.yml"), "--site-dir", str(site)],
        cwd=root, env=env, capture_output=True, text=True, timeout=600)
    return result.returncode, result.stdout + result.stderr


def test_the_site_builds_strict_with_no_warning(tmp_path: Path) -> None:
    code, output = build(ROOT, tmp_path / "site")
    warnings = [line for line in output.splitlines() if line.startswith(("WARNING", "ERROR"))]
    assert code == 0, output
    assert not warnings, output
    for path in reference.PAGES:
        page = tmp_path / "site" / path.removesuffix(".md") / "index.html"
        assert page.exists(), f"{path} was not generated"
    assert (tmp_path / "site" / "tutorial" / "index.html").exists()


def test_a_dead_anchor_fails_the_build(tmp_path: Path) -> None:
    """The strict build is what catches it, not only tests/test_docs.py."""
    shutil.copy(ROOT / "mkdocs.yml", tmp_path / "mkdocs.yml")
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    with (tmp_path / "docs" / "tutorial.md").open("a") as page:
        page.write("\nSee [nowhere](reference/errors.md#no-such-heading).\n")
    code, output = build(tmp_path, tmp_path / "site")
    assert code != 0
    assert "no-such-heading" in output, output


# -- the generated reference --------------------------------------------------


def test_every_key_code_metric_and_command_has_a_description() -> None:
    assert reference.undescribed() == []


def test_a_missing_description_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    bare = (("Somewhere", (Code("bare_code", "400", "invalid_request_error", "no", ""),)),)
    monkeypatch.setattr(reference, "CATALOGUE", (*CATALOGUE, *bare))
    assert reference.undescribed() == ["error code bare_code"]


def test_the_pages_list_every_key_code_metric_and_command() -> None:
    pages = reference.pages()
    config = pages["reference/configuration.md"]
    for key in schema.walk():
        section, _, leaf = key.name.rpartition(".")
        assert f"## `{reference.table(section)}`" in config, key.name
        assert f"| `{leaf}` |" in config, key.name
    errors = pages["reference/errors.md"]
    assert "| code | meaning |\n| --- | --- |\n| `1009` |" in errors  # no empty column
    assert all(f"| `{code.code}` |" in errors for _, codes in CATALOGUE for code in codes)
    metrics = pages["reference/metrics.md"]
    assert all(f"| `{m.prometheus}` | `{m.name}` |" in metrics for m in reference.instruments())
    assert "| `tidegate_edge_requests_total` |" in metrics
    commands = pages["reference/cli.md"]
    names = [name for name, _, _ in reference._commands(build_parser())]
    assert {"tidegate up", "tidegate keys create", "tidegate budget set"} <= set(names)
    assert all(f"## `{name}`" in commands for name in names if name != "tidegate")
    from edge.openapi import ROUTES

    http = pages["reference/http.md"]
    assert all(f"| {r.method} | `{r.path}` |" in http for r in ROUTES)
    assert "| POST | `/v1/messages` |" in http
    assert "bearer or x-api-key" in http


def test_a_section_is_named_as_its_toml_table() -> None:
    assert [reference.table(name) for name in ("edge", "models[0]", "models[0].queue")] == [
        "[edge]", "[[models]]", "[models.queue]"]


def test_a_keys_meaning_is_the_comment_where_it_is_declared() -> None:
    docs = {key.name: key.doc for key in schema.walk()}
    assert docs["edge.max_body_bytes"] == "larger request bodies get 413"
    assert docs["edge.slow_client_timeout"].startswith("A client whose socket does not drain")
    assert not docs["edge.max_json_depth"].startswith("--")  # a group's heading is no meaning


# -- the prose beside it --------------------------------------------------------

DOCS = ROOT / "docs"


def test_configuration_md_explains_only_keys_that_exist() -> None:
    """docs/configuration.md says why each default is what it is, in a list per
    table under a link to the reference; a key it names must still exist."""
    known: dict[str, set[str]] = {}
    for key in schema.walk():
        section, _, leaf = key.name.rpartition(".")
        known.setdefault(reference.table(section), set()).add(leaf)
    lists = re.findall(r"\[`(\[[^`]+\])`\]\(reference/configuration\.md#[a-z]+\) in the "
                       r"reference\. Why each is what it is:\n\n((?:- .*\n)+)",
                       (DOCS / "configuration.md").read_text())
    assert {table for table, _ in lists} == set(known)
    for table, items in lists:
        named = set(re.findall(r"^- `(\w+)`:", items, re.M))
        assert named, table
        assert sorted(named - known[table]) == [], table


def test_observability_md_explains_only_series_that_exist() -> None:
    text = (DOCS / "observability.md").read_text()
    every_series = text[text.index("### Every series"):text.index("\n## ", text.index(
        "### Every series"))]
    named = set(re.findall(r"^- `((?:tidegate|gen_ai)_\w+)`", every_series, re.M))
    assert len(named) > 20
    assert sorted(named - {m.prometheus for m in reference.instruments()}) == []


def test_the_tutorial_starts_with_the_readmes_run_command() -> None:
    assert quick_start_commands()["run"] in (DOCS / "tutorial.md").read_text()
