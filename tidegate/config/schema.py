"""The config schema as data: every leaf key with its type, default and meaning.

The meaning of a key is the comment where its field is declared in
``tidegate.config.sections``: the comment lines directly above the field and
the comment at the end of its line, joined. A section's meaning is its class
docstring. The generated reference (docs/reference/configuration.md, built by
``fleet.cli.reference``) and tests/test_config_schema.py walk the same keys.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import tokenize
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from typing import Any

from tidegate.config import sections
from tidegate.config.sections import Config


@dataclass(frozen=True, slots=True)
class Key:
    """One leaf key: ``edge.port``, ``models[0].queue.ttl``."""

    name: str
    type: Any
    default: Any  # dataclasses.MISSING when the key is required
    doc: str
    section: type[Any]  # the dataclass that declares the field


def walk(cls: type[Any] = Config, prefix: str = "") -> Iterator[Key]:
    """Every leaf key under ``cls``, the lists of tables (``models``, ``tiers``)
    walked as their first entry (``models[0]``)."""
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    for f in dataclasses.fields(cls):
        tp, name = hints[f.name], f"{prefix}{f.name}"
        if dataclasses.is_dataclass(tp):
            yield from walk(tp, f"{name}.")  # type: ignore[arg-type]
        elif cls is Config and f.name in ("models", "tiers"):
            yield from walk(typing.get_args(tp)[0], f"{name}[0].")
        else:
            default = (f.default_factory() if f.default_factory is not dataclasses.MISSING
                       else f.default)
            yield Key(name, tp, default, docs.get(f.name, ""), cls)


def section_doc(cls: type[Any]) -> str:
    """A section's meaning: its class docstring on one line ("" without one)."""
    return " ".join((cls.__doc__ or "").split()) if "__doc__" in vars(cls) else ""


@cache
def _comments() -> dict[int, str]:
    """Line number -> the comment on that line of tidegate.config.sections."""
    source = inspect.getsource(sections)
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    return {tok.start[0]: tok.string.lstrip("#").strip()
            for tok in tokens if tok.type == tokenize.COMMENT}


@cache
def _lines() -> tuple[str, ...]:
    return tuple(inspect.getsource(sections).splitlines())


@cache
def _classes() -> dict[str, list[ast.stmt]]:
    """Class name -> its body, for every class of tidegate.config.sections."""
    tree = ast.parse(inspect.getsource(sections))
    return {node.name: node.body for node in tree.body if isinstance(node, ast.ClassDef)}


def field_docs(cls: type[Any]) -> dict[str, str]:
    """Field name -> its comments, for a dataclass of tidegate.config.sections.

    A comment line starting with ``--`` heads a group of fields; it is no
    field's meaning.
    """
    if cls.__module__ != sections.__name__:
        return {}
    comments, lines = _comments(), _lines()
    out: dict[str, str] = {}
    for node in _classes()[cls.__name__]:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        above: list[str] = []
        line = node.lineno - 1
        while line in comments and lines[line - 1].lstrip().startswith("#"):
            above.insert(0, comments[line])
            line -= 1
        parts = [text for text in above if not text.startswith("--")]
        end = node.end_lineno or node.lineno
        parts += [comments[n] for n in range(node.lineno, end + 1) if n in comments]
        out[node.target.id] = " ".join(parts)
    return out
