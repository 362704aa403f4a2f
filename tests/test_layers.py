"""The house's floors, read from the code's own imports (every ``import``,
lazy and ``TYPE_CHECKING`` ones included): each package imports only its
own floor's modules or lower ones, the tiers never import each other, and no
modules import each other in a circle. MAP.md ("Layers")
names the floors; a new package gets its line in FLOORS or fails here.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TOPS = ("tidegate", "edge", "dispatcher", "workers", "fleet", "bench")
# Packages whose subpackages are floors of their own.
SPLIT = ("tidegate", "fleet")

# Ground first. Equal numbers are one floor: its packages may not import
# each other (the tiers are the floor that matters).
FLOORS = {
    "tidegate": 0,  # the package's face: its version only
    "tidegate.errors": 1,
    "tidegate.wire": 2,
    "tidegate.config": 3,
    "tidegate.telemetry": 4,
    "tidegate.validation": 4,
    "tidegate.apis": 5,  # one module per API dialect (its knowledge, asked, not branched on)
    "tidegate.broker": 5,
    "tidegate.control": 6,
    "edge": 7,
    "dispatcher": 7,
    "workers": 7,
    "fleet": 8,  # the tools' face: a docstring
    "fleet.run": 8,
    "bench": 9,  # not in the wheel: the checkout's tools (tidegate bench, chaos)
    "fleet.cli": 10,
    "fleet.__main__": 11,
}


def modules() -> dict[str, Path]:
    out = {}
    for top in TOPS:
        for path in (ROOT / top).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            out[name.removesuffix(".__init__")] = path
    return out


def package(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] in SPLIT and len(parts) > 1 else parts[0]


def imports(path: Path, known: dict[str, Path]) -> Iterator[str]:
    """The project modules ``path`` imports (``from a import b`` counts
    ``a.b`` when that is a module, else ``a``)."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in known
                     else node.module for alias in node.names]
        else:
            continue
        for name in names:
            while name and name not in known:  # a.b.C -> a.b
                name = name.rpartition(".")[0]
            if name:
                yield name


def graph() -> dict[str, set[str]]:
    known = modules()
    return {m: {t for t in imports(p, known) if t != m} for m, p in known.items()}


def test_every_package_has_a_floor() -> None:
    assert not sorted({package(m) for m in modules()} - FLOORS.keys())


def test_imports_run_down_the_floors_and_not_across_tiers() -> None:
    wrong = []
    for module, targets in graph().items():
        here = package(module)
        for target in targets:
            there = package(target)
            if there != here and FLOORS[there] >= FLOORS[here]:
                wrong.append(f"{module} -> {target}")
    assert not wrong, "imports that run up or across a floor:\n" + "\n".join(sorted(wrong))


def test_the_core_package_stands_below_the_tiers_and_the_tools_above() -> None:
    """The ground package ``tidegate`` is ground only (no import of it runs up
    to a tier or a tool, so it can be read alone), and ``fleet`` is the roof."""
    tiers = {FLOORS[t] for t in ("edge", "dispatcher", "workers")}
    assert len(tiers) == 1
    core = {p: f for p, f in FLOORS.items() if p.split(".")[0] == "tidegate"}
    tools = {p: f for p, f in FLOORS.items() if p.split(".")[0] == "fleet"}
    assert max(core.values()) < min(tiers) < min(tools.values())


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            scc = []
            while True:
                w = stack.pop()
                on.discard(w)
                scc.append(w)
                if w == v:
                    break
            if len(scc) > 1:
                found.append(sorted(scc))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_no_modules_import_each_other_in_a_circle() -> None:
    assert circles(graph()) == []


@pytest.mark.parametrize(("edges", "expected"), [
    ({"a": {"b"}, "b": {"a"}, "c": {"a"}}, [["a", "b"]]),
    ({"a": {"b"}, "b": {"c"}}, []),
])
def test_the_circle_finder_finds_circles(edges: dict[str, set[str]],
                                         expected: list[list[str]]) -> None:
    assert circles(edges) == expected
