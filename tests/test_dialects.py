"""API dialects (``tidegate.apis``): the knowledge of each API lives in its
module, and the rest of the product asks it.

Counted from the code's own syntax: references to ``Api`` members outside
``tidegate.apis`` (and ``tidegate.wire.protocol``, which defines them), and
private names imported across modules. The budgets only go down: a change
that adds a branch on ``Api`` elsewhere, or imports another module's
private name, fails here (issue 46 takes both to 0).
"""

from __future__ import annotations

import ast
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from tidegate import apis
from tidegate.wire.protocol import Api

ROOT = Path(__file__).resolve().parent.parent
TOPS = ("tidegate", "edge", "dispatcher", "workers", "fleet")
HOME = ("tidegate/apis/", "tidegate/wire/protocol.py")

# What is left, module by module, until the dialects own it.
API_BRANCHES_BUDGET = 0
PRIVATE_IMPORTS_BUDGET = 0


def _product_files() -> list[Path]:
    return sorted(p for top in TOPS for p in (ROOT / top).rglob("*.py"))


def api_member_uses(files: list[Path], root: Path = ROOT) -> dict[str, int]:
    """``Api.X`` references per file, outside the dialects' home."""
    members = set(Api.__members__)
    out: dict[str, int] = {}
    for path in files:
        rel = path.relative_to(root).as_posix()
        if rel.startswith(HOME):
            continue
        count = sum(1 for node in ast.walk(ast.parse(path.read_text()))
                    if isinstance(node, ast.Attribute) and node.attr in members
                    and isinstance(node.value, ast.Name) and node.value.id == "Api")
        if count:
            out[rel] = count
    return out


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_imports(files: list[Path], root: Path = ROOT) -> list[str]:
    """Another project module's private names: ``from project.module import
    _name``, and ``module._name`` on a module imported by name."""
    found = []
    for path in files:
        tree = ast.parse(path.read_text())
        modules: dict[str, str] = {}  # local name -> project module
        for node in ast.walk(tree):
            if (isinstance(node, ast.ImportFrom) and node.module and node.level == 0
                    and node.module.split(".")[0] in TOPS):
                found += [f"{path.relative_to(root)}: {node.module}.{a.name}"
                          for a in node.names if _private(a.name)]
                modules.update({a.asname or a.name: f"{node.module}.{a.name}"
                                for a in node.names if not _private(a.name)})
            elif isinstance(node, ast.Import):
                modules.update({a.asname: a.name for a in node.names
                                if a.asname and a.name.split(".")[0] in TOPS})
        found += [f"{path.relative_to(root)}: {modules[node.value.id]}.{node.attr}"
                  for node in ast.walk(tree)
                  if isinstance(node, ast.Attribute) and _private(node.attr)
                  and isinstance(node.value, ast.Name) and node.value.id in modules]
    return found


def test_api_branches_outside_the_dialects_only_go_down() -> None:
    uses = api_member_uses(_product_files())
    total = sum(uses.values())
    print(f"Api member uses outside tidegate.apis: {total} in {len(uses)} modules")
    assert total <= API_BRANCHES_BUDGET, sorted(uses.items(), key=lambda kv: -kv[1])


def test_private_imports_across_modules_only_go_down() -> None:
    found = private_imports(_product_files())
    print(f"private names imported across modules: {len(found)}")
    assert len(found) <= PRIVATE_IMPORTS_BUDGET, found


def test_the_counters_see_what_they_count(tmp_path: Path) -> None:
    (tmp_path / "edge").mkdir()
    code = tmp_path / "edge" / "m.py"
    code.write_text("from tidegate.wire.protocol import Api\n"
                    "from edge.errors import _private\n"
                    "from tidegate.validation import messages\n"
                    "def f(api):\n    return api is Api.CHAT or api >= Api.RESPONSES\n"
                    "ROLES = messages._ROLES\n")
    assert api_member_uses([code], tmp_path) == {"edge/m.py": 2}
    assert private_imports([code], tmp_path) == ["edge/m.py: edge.errors._private",
                                                 "edge/m.py: tidegate.validation.messages._ROLES"]


@pytest.mark.parametrize("dialect", apis.ALL, ids=lambda d: d.api.name.lower())
def test_each_dialect_is_found_by_its_api_and_its_path(dialect: apis.Dialect) -> None:
    assert apis.of(dialect.api) is dialect
    assert apis.of(int(dialect.api)) is dialect  # as a Request carries it on the wire
    assert apis.by_path(f"/v1{dialect.path}") is dialect


def test_every_api_has_a_dialect() -> None:
    assert sorted(d.api for d in apis.ALL) == sorted(Api)


@pytest.mark.parametrize(("body", "cap"), [
    ({"max_tokens": 50, "max_completion_tokens": 70}, 50),
    ({"max_completion_tokens": 70}, 70),
    ({}, None),
    ({"max_tokens": True}, None),
])
def test_chats_output_cap_is_the_smaller_of_its_two_fields(body: Mapping[str, Any],
                                                           cap: int | None) -> None:
    assert apis.of(Api.CHAT).output_cap(body) == cap
