"""Plain-text tables that fit a terminal's width, and ``tidegate status``'s view.

Invariant: no cell is ever cut. :func:`render_table` tries, in order, until
every line fits ``width``: one line per row with full headers; short headers
(``Column.short``); wrapped columns (``Column.wrap``); panels of column groups,
each repeating the key column; one block per row, ``header  value`` per line.

:func:`render` turns :func:`fleet.run.status.document`'s output into the
view; ``--json`` prints that document itself, so the two never disagree.
"""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

GAP = "  "  # between two columns
_PIECE = re.compile(r"(\s*)(\S*?[/,]|\S+)")  # a word: up to and including a / or ,


@dataclass(frozen=True, slots=True)
class Column:
    name: str
    short: str = ""  # header when the full one does not fit; "" = the name
    right: bool = False  # numbers align right
    wrap: bool = False  # may take more lines than one


@dataclass(slots=True)
class Table:
    title: str
    columns: tuple[Column, ...]
    rows: list[tuple[str, ...]] = field(default_factory=list)
    empty: str = ""  # printed under the title when there are no rows

    def add(self, *cells: object) -> None:
        if len(cells) != len(self.columns):
            raise ValueError(f"{self.title}: {len(cells)} cells for {len(self.columns)} columns")
        self.rows.append(tuple(str(c) for c in cells))


def wrap(text: str, width: int) -> list[str]:
    """``text`` in lines of at most ``width`` characters (at least one line).

    Breaks at whitespace (dropped) and after ``/`` and ``,`` (kept), so
    ``meta-llama/Llama-3.1-8B`` splits after the slash; a word longer than
    ``width`` is cut into ``width``-sized parts. Joining the lines (a space
    where whitespace was dropped) gives ``text`` back.
    """
    width = max(1, width)
    lines: list[str] = []
    line = ""
    for match in _PIECE.finditer(text):
        space, word = match.group(1), match.group(2)
        if not word:
            continue
        glue = " " if space and line else ""
        if len(line) + len(glue) + len(word) <= width:
            line += glue + word
            continue
        if line:
            lines.append(line)
        while len(word) > width:
            lines.append(word[:width])
            word = word[width:]
        line = word
    lines.append(line)
    return lines


def _longest_word(text: str) -> int:
    return max((len(m.group(2)) for m in _PIECE.finditer(text)), default=0)


def render_table(table: Table, width: int) -> list[str]:
    """``table`` as lines of at most ``width`` characters (see the module doc)."""
    width = max(20, width)
    out = wrap(table.title, width) if table.title else []
    if not table.rows:
        return out + ([f"  {line}" for line in wrap(table.empty, width - 2)]
                      if table.empty else [])
    everything = list(range(len(table.columns)))
    for short in (False, True):
        widths = _fit(table, everything, short, width, wrapping=False)
        if widths is not None:
            return out + _lines(table, everything, short, widths)
    widths = _fit(table, everything, True, width, wrapping=True)
    if widths is not None:
        return out + _lines(table, everything, True, widths)
    panels = _panels(table, width)
    if panels is None:
        return out + _records(table, width)
    for n, (columns, short, widths) in enumerate(panels):
        out += ([""] if n else []) + _lines(table, columns, short, widths)
    return out


def _header(column: Column, short: bool) -> str:
    return (column.short or column.name) if short else column.name


def _fit(table: Table, columns: Sequence[int], short: bool, width: int,
         wrapping: bool) -> list[int] | None:
    """Widths of ``columns`` that fit ``width``, or None. Without ``wrapping``
    every cell stays on one line; with it, wrappable columns give up width
    (the widest first) down to their header or longest word."""
    natural: list[int] = []
    least: list[int] = []
    for i in columns:
        column = table.columns[i]
        head = len(_header(column, short))
        cells = [row[i] for row in table.rows]
        natural.append(max(head, *(len(c) for c in cells)))
        least.append(max(head, *(_longest_word(c) for c in cells))
                     if wrapping and column.wrap else natural[-1])
    room = width - len(GAP) * (len(natural) - 1)
    if sum(least) > room:
        return None
    widths = list(natural)
    while sum(widths) > room:
        k = max(range(len(widths)), key=lambda j: widths[j] - least[j])
        widths[k] -= 1
    return widths


Panel = tuple[list[int], bool, list[int]]  # columns, short headers, widths


def _panels(table: Table, width: int) -> list[Panel] | None:
    """Column groups, each led by the key column, that fit ``width``; None
    when the key and any one other column do not fit side by side. Fewest
    panels first; among as many, cells on one line before wrapped ones, then
    full headers before short ones."""
    options = [(len(p), wrapping, short, p)
               for wrapping in (False, True) for short in (False, True)
               if (p := _split(table, width, short, wrapping)) is not None]
    return min(options, key=lambda o: o[:3])[3] if options else None


def _split(table: Table, width: int, short: bool, wrapping: bool) -> list[Panel] | None:
    panels: list[Panel] = []
    group = [0]
    fitted: list[int] | None = None
    for i in range(1, len(table.columns)):
        trial = _fit(table, [*group, i], short, width, wrapping)
        if trial is None and fitted is not None:  # start the next panel with the key
            panels.append((group, short, fitted))
            group, fitted = [0], None
            trial = _fit(table, [0, i], short, width, wrapping)
        if trial is None:
            return None
        group, fitted = [*group, i], trial
    if fitted is not None:
        panels.append((group, short, fitted))
    return panels


def _lines(table: Table, columns: Sequence[int], short: bool, widths: Sequence[int]) -> list[str]:
    spec = [table.columns[i] for i in columns]
    head = [_header(c, short) for c in spec]
    out = [_join(head, spec, widths), _join(["-" * w for w in widths], spec, widths)]
    for row in table.rows:
        cells = [wrap(row[i], w) for i, w in zip(columns, widths, strict=True)]
        for k in range(max(len(c) for c in cells)):
            out.append(_join([c[k] if k < len(c) else "" for c in cells], spec, widths))
    return out


def _join(cells: Sequence[str], spec: Sequence[Column], widths: Sequence[int]) -> str:
    return GAP.join(c.rjust(w) if s.right else c.ljust(w)
                    for c, s, w in zip(cells, spec, widths, strict=True)).rstrip()


def _records(table: Table, width: int) -> list[str]:
    label = max(len(c.name) for c in table.columns)
    names: Sequence[str] = [c.name for c in table.columns]
    if width - label - len(GAP) < 12:  # full names leave too little room for values
        names = [c.short or c.name for c in table.columns]
        label = max(len(n) for n in names)
    room = max(1, width - label - len(GAP))
    out: list[str] = []
    for n, row in enumerate(table.rows):
        out += [""] if n else []
        for name, cell in zip(names, row, strict=True):
            for k, line in enumerate(wrap(cell, room)):
                out.append(f"{name if k == 0 else '':<{label}}{GAP}{line}".rstrip())
    return out


def pack(fields: Sequence[str], width: int) -> list[str]:
    """``fields`` on as few lines of at most ``width`` as fit, in order,
    ``GAP`` apart; a field longer than a line is wrapped by itself."""
    lines: list[str] = []
    line = ""
    for f in fields:
        if line and len(line) + len(GAP) + len(f) <= width:
            line += GAP + f
            continue
        if line:
            lines.append(line)
        *full, line = wrap(f, width)
        lines += full
    return lines + ([line] if line else [])


# --------------------------------------------------------------------------
# tidegate status
# --------------------------------------------------------------------------


def render(doc: dict[str, Any], width: int) -> str:
    """``tidegate status``'s view of :func:`fleet.run.status.document`,
    every line at most ``width`` characters."""
    rps = doc["requests_per_s"]
    lines = pack(["tidegate status", f"nats {doc['nats']}",
                  f"dispatch backlog {doc['dispatch_backlog']}",
                  f"requests/s {'-' if rps is None else f'{rps:g}'}",
                  time.strftime("%H:%M:%S", time.localtime(doc["taken"]))], width)
    tables = [models_table(doc["models"])]
    replicas = replicas_table(doc["models"])
    if replicas.rows:
        tables.append(replicas)
    tables.append(workers_table(doc["workers"]))
    if doc.get("edges") is not None:
        tables.append(edges_table(doc["edges"]))
    if doc.get("batches"):
        tables.append(batches_table(doc["batches"]))
    if doc.get("processes"):
        tables.append(processes_table(doc["processes"]))
    for table in tables:
        lines += ["", *render_table(table, width)]
    return "\n".join(lines) + "\n"


def held(queue_mode: dict[str, Any]) -> str:
    """Requests held in queue mode: the count, and by class when any is not
    interactive ("5 (i3 bg2)")."""
    total = queue_mode["queued"]
    by_class = {k: n for k, n in (queue_mode.get("queued_by_class") or {}).items() if n}
    if not total or set(by_class) <= {"interactive"}:
        return str(total)
    short = {"interactive": "i", "background": "bg", "batch": "b"}
    return f"{total} ({' '.join(f'{short.get(k, k)}{n}' for k, n in by_class.items())})"


def models_table(models: list[dict[str, Any]]) -> Table:
    table = Table("Models", (
        Column("model", wrap=True), Column("workers", "wrk", right=True),
        Column("slots used/total", "slots", right=True), Column("waiting", "wait", right=True),
        Column("running", "run", right=True), Column("oldest", right=True), Column("mode"),
        Column("limit", "lim", right=True), Column("p99 TTFT", "p99", right=True),
        Column("held", right=True), Column("started/s", "start/s", right=True),
        Column("finished/s", "done/s", right=True)), empty="no models configured")
    for m in models:
        qm, q, slots, rates = m["queue_mode"], m["queue"], m["slots"], m["rates"]
        mode = "-" if qm is None else qm["mode"]
        table.add(
            m["model"],
            # A model with jobs and no worker to run them is the first thing to see.
            f"{m['workers']}{'!' if not m['workers'] and q['depth'] else ''}",
            f"{slots['used']}/{slots['total']}{' auto' if m.get('adaptive') else ''}",
            q["waiting"], q["running"], age(q["oldest_age_s"]), mode,
            "-" if qm is None or mode != "queue" else qm["limit"],
            "-" if qm is None or not qm["p99_ms"] else f"{qm['p99_ms']:.0f} ms",
            "-" if qm is None else held(qm),
            "-" if rates is None else f"{rates['started_per_s']:g}",
            "-" if rates is None else f"{rates['finished_per_s']:g}")
    return table


def replicas_table(models: list[dict[str, Any]]) -> Table:
    table = Table("Replicas", (
        Column("model", wrap=True), Column("replica", wrap=True),
        Column("workers", "wrk", right=True), Column("in flight/slots", "busy", right=True),
        Column("affinity hit rate", "affinity", wrap=True)))
    for m in models:
        for r in m.get("replicas") or ():
            table.add(m["model"], r["replica"], r["workers"], f"{r['in_flight']}/{r['slots']}",
                      "-" if r["hit_rate"] is None else f"{r['hit_rate']:.0%} of {r['jobs']}")
    return table


def workers_table(workers: list[dict[str, Any]]) -> Table:
    table = Table("Workers", (
        Column("worker", wrap=True), Column("host", wrap=True), Column("pid", right=True),
        Column("up", right=True), Column("models (in flight/slots)", "models", wrap=True),
        Column("heartbeat", "beat", right=True)), empty="no live workers")
    for w in workers:
        served = ", ".join(
            f"{m} {s['in_flight']}/{s['slots']}{' auto' if s.get('adaptive') else ''}"
            for m, s in w["models"].items())
        table.add(w["worker_id"] + (" (draining)" if w["draining"] else ""), w["host"],
                  w["pid"], age(w["uptime_s"]), served, f"{w['heartbeat_age_s']:.0f}s ago")
    return table


def edges_table(edges: dict[str, Any]) -> Table:
    total = edges["total"]
    table = Table(f"Edges: {total['edges']} live, {total['streams']} open requests, "
                  f"{total['ws_connections']} WebSockets running "
                  f"{total['ws_generations']} generations", (
                      Column("edge", wrap=True), Column("host", wrap=True),
                      Column("open requests", "open", right=True),
                      Column("WebSockets", "ws", right=True),
                      Column("ws generations", "ws gen", right=True),
                      Column("up", right=True)))
    for e in edges["edges"]:
        table.add(e["edge_id"] + (" (draining)" if e["draining"] else ""), e["host"],
                  e["streams"], e["ws_connections"], e["ws_generations"], age(e["uptime_s"]))
    return table


def batches_table(rows: list[dict[str, Any]]) -> Table:
    """Active batches: rows of :func:`tidegate.control.batch_admin.row`."""
    table = Table("Batches", (
        Column("batch"), Column("tenant", wrap=True), Column("status"),
        Column("done/total", "done", right=True), Column("failed", right=True),
        Column("expires in", "expires", right=True)))
    for r in rows:
        table.add(r["id"], r["tenant"], r["status"],
                  f"{r['completed'] + r['failed']}/{r['total']}", r["failed"],
                  f"{r['expires_in_s']}s")
    return table


def processes_table(processes: list[dict[str, Any]]) -> Table:
    table = Table("Processes (tidegate up)", (
        Column("process", wrap=True), Column("pid", right=True), Column("state"),
        Column("restarts", right=True), Column("last exit code", "exit", right=True)))
    for p in processes:
        state = "running" if p["running"] else (
            "restarting" if p["restart_pending"] else "down")
        table.add(p["name"], p["pid"], state, p["restarts"],
                  "-" if p["last_exit_code"] is None else p["last_exit_code"])
    return table


def age(seconds: float) -> str:
    if seconds <= 0:
        return "-"
    if seconds < 60:
        return f"{seconds:.1f}s"
    if seconds < 3600:
        return f"{seconds // 60:.0f}m{seconds % 60:02.0f}s"
    return f"{seconds // 3600:.0f}h{seconds % 3600 // 60:02.0f}m"
