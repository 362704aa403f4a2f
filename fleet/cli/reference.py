"""The reference pages of the docs site, generated from the code they describe.

Configuration from the config dataclasses (``tidegate.config.schema``), errors
from ``tidegate.errors.CATALOGUE``, metrics from the instruments
``tidegate.telemetry.telemetry.Metrics`` creates, the CLI from
:func:`fleet.cli.build_parser`, the HTTP routes from the edge's OpenAPI
table (``edge.openapi.ROUTES``). docs/hooks.py hands :func:`pages` to
``mkdocs build``, so the pages exist only in the built site and cannot drift;
:func:`undescribed` is what tests/test_docs_site.py holds at empty.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal, cast

from opentelemetry.metrics import Meter

from fleet.cli import build_parser
from tidegate.config import schema
from tidegate.errors import CATALOGUE
from tidegate.telemetry.telemetry import Metrics

# Paths under docs/ -> (title, what the page is generated from).
PAGES = {
    "reference/configuration.md": "Configuration keys",
    "reference/errors.md": "Error codes",
    "reference/metrics.md": "Metrics",
    "reference/cli.md": "Command line",
    "reference/http.md": "HTTP routes",
}
NOTE = "Generated from the code by `fleet.cli.reference` at every docs build: do not edit."


def pages() -> dict[str, str]:
    """Every generated page, by its path under docs/."""
    return {
        "reference/configuration.md": _configuration(),
        "reference/errors.md": _errors(),
        "reference/metrics.md": _metrics(),
        "reference/cli.md": _cli(build_parser()),
        "reference/http.md": _http(),
    }


def undescribed() -> list[str]:
    """Config keys and sections, error codes, metrics, commands and their
    arguments without a description."""
    out = [f"config key {key.name}" for key in schema.walk() if not key.doc]
    out += [f"config section [{name}]" for name, cls in _sections() if not schema.section_doc(cls)]
    out += [f"error code {code.code}" for _, codes in CATALOGUE for code in codes
            if not code.meaning]
    out += [f"metric {m.name}" for m in instruments() if not m.description]
    out += [f"route {r.method} {r.path}" for r in _routes() if not r.summary]
    for name, parser, help_ in _commands(build_parser()):
        if not (help_ or parser.description):
            out.append(f"command {name}")
        out += [f"argument {' '.join(action.option_strings) or action.dest} of {name}"
                for action in _arguments(parser) if not action.help]
    return out


# -- HTTP routes ----------------------------------------------------------------


def _routes() -> tuple[Any, ...]:
    from edge.openapi import ROUTES  # the edge's own table (its test holds it to the app)

    return ROUTES


def _http() -> str:
    lines = [f"# {PAGES['reference/http.md']}", "", NOTE, "",
             "Every route an edge serves, from the table `GET /openapi.json` is built "
             "from (OpenAPI 3.1, with each request body's schema: point an API tool at "
             "it). **Key**: `Authorization: Bearer <key>`; Anthropic's routes also take "
             "`x-api-key` and answer errors in Anthropic's shape; *none*: no key. "
             "`/metrics` is served here only with `edge.metrics_public`.", "",
             "| method | path | what | body | success | key |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in _routes():
        extras = [f"`{name}`" for name, _ in (*r.query, *r.headers)]
        what = r.summary + (f"; takes {', '.join(extras)}" if extras else "")
        key = "none" if r.keyless else ("bearer or x-api-key" if r.anthropic else "bearer")
        lines.append(f"| {r.method} | `{r.path}` | {_cell(what)} | "
                     f"{f'`{r.body}`' if r.body else '-'} | {r.status} "
                     f"{', '.join(r.ok)} | {key} |")
    return "\n".join([*lines, ""])


# -- configuration ------------------------------------------------------------


def _sections() -> list[tuple[str, type[Any]]]:
    """``(name, dataclass)`` of every table a TOML file may have, in order."""
    out: dict[str, type[Any]] = {}
    for key in schema.walk():
        out.setdefault(key.name.rpartition(".")[0], key.section)
    return list(out.items())


def _configuration() -> str:
    lines = [f"# {PAGES['reference/configuration.md']}", "", NOTE, "",
             "Every key of the TOML file, by section. Sizes are bytes, durations seconds. "
             "A key of a section can also be set as `TIDEGATE__<SECTION>__<KEY>`; "
             "[configuration](../configuration.md) says where values come from and how "
             "they are checked.", ""]
    by_section: dict[str, list[schema.Key]] = {}
    for key in schema.walk():
        by_section.setdefault(key.name.rpartition(".")[0], []).append(key)
    for name, cls in _sections():
        lines += [f"## `{table(name)}`", "", _links(schema.section_doc(cls)), "",
                  "| key | type | default | meaning |", "| --- | --- | --- | --- |"]
        for key in by_section[name]:
            leaf = key.name.rpartition(".")[2]
            default = _default(key.default) + (_size(key.default) if "bytes" in leaf else "")
            lines.append(f"| `{leaf}` | {_type(key.type)} | {default} | {_cell(key.doc)} |")
        lines.append("")
    return "\n".join(lines)


def table(section: str) -> str:
    """The TOML table a section is: ``[edge]``, ``[[models]]``, ``[models.queue]``,
    ``[[tiers]]``."""
    if section in ("models[0]", "tiers[0]"):
        return f"[[{section[:-3]}]]"
    return f"[{section.replace('models[0].', 'models.')}]"


def _size(value: Any) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if isinstance(value, int) and value >= 1 << shift and value % (1 << shift) == 0:
            return f" ({value >> shift} {unit})"
    return ""


def _type(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return " or ".join(f'`"{v}"`' for v in typing.get_args(tp))
    if typing.get_origin(tp) in (types.UnionType, typing.Union):
        return " or ".join(_type(t) for t in typing.get_args(tp) if t is not type(None))
    if typing.get_origin(tp) is tuple:
        return f"list of {_type(typing.get_args(tp)[0])}"
    return {int: "int", float: "float", str: "string", bool: "bool"}.get(tp, str(tp))


def _default(value: Any) -> str:
    if value is dataclasses.MISSING:
        return "required"
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, str):
        return f'`"{value}"`'
    if isinstance(value, tuple):
        if value and dataclasses.is_dataclass(value[0]):
            return "one simulator model"
        return "`[" + ", ".join(_default(v).strip("`") for v in value) + "]`"
    return f"`{value}`"


# -- errors ---------------------------------------------------------------------


def _errors() -> str:
    lines = [f"# {PAGES['reference/errors.md']}", "", NOTE, "",
             "Every error code a client can see, by where it comes from. "
             "[Errors](../errors.md) explains the shape: an HTTP status before the first "
             "byte, a final event after it, a frame on a WebSocket, a line in a batch's "
             "error file. **Retry** *yes* means the same request may succeed later or on "
             "another node, after `Retry-After` when given.", ""]
    for group, codes in CATALOGUE:
        columns = [c for c in ("status", "type", "retry")
                   if any(getattr(code, c) for code in codes)]
        lines += [f"## {group}", "", "| " + " | ".join(["code", *columns, "meaning"]) + " |",
                  "| --- " * (len(columns) + 2) + "|"]
        for code in codes:
            cells = [f"`{code.code}`"]
            cells += [_code_spans(getattr(code, c)) if c == "type" else _cell(getattr(code, c))
                      for c in columns]
            lines.append("| " + " | ".join([*cells, _cell(code.meaning)]) + " |")
        lines.append("")
    return "\n".join(lines)


def _code_spans(text: str) -> str:
    return " / ".join(f"`{part.strip()}`" for part in text.split("/"))


# -- metrics ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Instrument:
    name: str  # the OpenTelemetry name
    kind: str  # counter, histogram or gauge
    unit: str
    description: str

    @property
    def prometheus(self) -> str:
        """The series name on /metrics: dots as underscores, seconds and
        ``_total`` appended; annotations (``{request}``) and ``1`` add nothing."""
        name = self.name.replace(".", "_") + ("_seconds" if self.unit == "s" else "")
        return name + ("_total" if self.kind == "counter" else "")


class _Recorder:
    """Stands in for an OpenTelemetry Meter: keeps what each instrument is."""

    def __init__(self) -> None:
        self.instruments: list[Instrument] = []

    def _create(self, kind: str, name: str, unit: str = "", description: str = "",
                **_options: Any) -> None:
        self.instruments.append(Instrument(name, kind, unit, description))

    def create_counter(self, name: str, **kw: Any) -> None:
        self._create("counter", name, **kw)

    def create_histogram(self, name: str, **kw: Any) -> None:
        self._create("histogram", name, **kw)

    def create_gauge(self, name: str, **kw: Any) -> None:
        self._create("gauge", name, **kw)

    def create_observable_gauge(self, name: str, **kw: Any) -> None:
        self._create("gauge", name, **kw)


def instruments() -> list[Instrument]:
    """Every instrument a tidegate process records."""
    recorder = _Recorder()
    Metrics(cast(Meter, recorder))
    return recorder.instruments


def _metrics() -> str:
    lines = [f"# {PAGES['reference/metrics.md']}", "", NOTE, "",
             "Every instrument tidegate records, with its OpenTelemetry name and the "
             "series it becomes on `/metrics`. [Observability](../observability.md#metrics) "
             "says which process exports what, the labels, and how to scrape it.", "",
             "| Prometheus | OpenTelemetry | type | unit | meaning |",
             "| --- | --- | --- | --- | --- |"]
    for m in instruments():
        lines.append(f"| `{m.prometheus}` | `{m.name}` | {m.kind} | `{m.unit}` "
                     f"| {_cell(m.description)} |")
    return "\n".join([*lines, ""])


# -- command line -------------------------------------------------------------------


def _commands(parser: argparse.ArgumentParser, prefix: str = "tidegate",
              help_: str = "") -> Iterator[tuple[str, argparse.ArgumentParser, str]]:
    """``(command line, parser, its help)`` of every command, depth first."""
    yield prefix, parser, help_
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help or "" for a in action._choices_actions}
            for name, sub in action.choices.items():
                yield from _commands(sub, f"{prefix} {name}", helps.get(name, ""))


def _arguments(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """A command's own arguments: not --help, not its subcommands, not hidden ones."""
    return [a for a in parser._actions if a.help != argparse.SUPPRESS
            and not isinstance(a, argparse._HelpAction | argparse._SubParsersAction)]


def _cli(root: argparse.ArgumentParser) -> str:
    lines = [f"# {PAGES['reference/cli.md']}", "", NOTE, "",
             "Every `tidegate` command with its arguments, as `tidegate COMMAND --help` "
             "prints them.", ""]
    for name, parser, help_ in _commands(root):
        if name == "tidegate":
            continue
        parser.formatter_class = lambda prog: argparse.HelpFormatter(prog, width=88)
        lines += [f"## `{name}`", "", _links(_sentence(parser.description or help_)), "",
                  "```", parser.format_usage().strip(), "```", ""]
        rows = _arguments(parser)
        if rows:
            lines += ["| argument | meaning |", "| --- | --- |"]
            for action in rows:
                flags = ", ".join(action.option_strings) or action.metavar or action.dest
                what = str(action.help or "")
                if "%(" in what:
                    what %= {**vars(action), "prog": name}
                lines.append(f"| `{flags}` | {_cell(what)} |")
            lines.append("")
    return "\n".join(lines)


# -- Markdown ---------------------------------------------------------------------


def _sentence(text: str) -> str:
    text = " ".join(text.split())
    return text[:1].upper() + text[1:] + ("" if text.endswith(".") else ".")


def _links(text: str) -> str:
    """Links written relative to docs/, made relative to docs/reference/."""
    return re.sub(r"\]\((?![a-z][a-z0-9+.-]*:|#|/)", "](../", text)


def _cell(text: str) -> str:
    return _links(text).replace("|", "\\|").replace("\n", " ")
