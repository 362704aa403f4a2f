"""``tidegate status``'s view rendered to a string at 80 and 200 columns (and
narrower): every line fits, no cell is cut, every value is still there."""

from __future__ import annotations

import io
import re
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fleet.run import status, status_view
from fleet.run.status_view import Column, Table, render_table, wrap
from tidegate import config as tgconfig
from tidegate.control.queue_stats import ModelQueue, Snapshot
from tidegate.control.workers_registry import ReplicaSlot, SlotInfo, WorkerInfo

# Names as long as real ones: the rich table of old cut these to "tid…", "nor…".
MODELS = ("tidegate-sim", "meta-llama/Llama-3.1-8B-Instruct", "normal-slow-model")
WORKER_IDS = ("a3f09c1d2e4b", "77c0de51f2a9")
HOST = "gpu-node-17.eu-west.internal"
BATCH = "batch_0123456789abcdef0123456789abcdef"


def sample() -> dict[str, Any]:
    """A busy fleet's document, built by the same :func:`status.document`
    that ``--json`` prints."""
    config = tgconfig.from_dict({"models": [
        {"name": m, "simulator": {"ttft": 0.01}} for m in MODELS]})
    now = 1_790_000_000.0
    workers = (
        WorkerInfo(WORKER_IDS[0], HOST, 48213, now - 7300, now - 2,
                   {MODELS[0]: SlotInfo(8, 3), MODELS[1]: SlotInfo(24, 17, adaptive=True)},
                   replicas={MODELS[1]: {"http://10.0.0.5:8000": ReplicaSlot(12, 9, jobs=40,
                                                                             hits=31),
                                         "http://10.0.0.6:8000": ReplicaSlot(12, 8)}}),
        WorkerInfo(WORKER_IDS[1], HOST, 48999, now - 65, now - 1,
                   {MODELS[2]: SlotInfo(4, 4)}, draining=True),
    )

    def snap(taken: float, delivered: int, finished: int, requests: int) -> Snapshot:
        return Snapshot(taken, (
            ModelQueue(MODELS[0], waiting=0, running=3, delivered=delivered, consumer=True),
            ModelQueue(MODELS[1], waiting=1234, running=17, oldest_age=754.2,
                       delivered=delivered * 2, consumer=True),
            ModelQueue(MODELS[2], waiting=5, running=4, oldest_age=3.5, delivered=7,
                       consumer=True)),
            backlog=42, requests_total=requests,
            finished={m: finished for m in MODELS}, workers=workers)

    modes = {MODELS[0]: status.QueueModeView("normal"),
             MODELS[1]: status.QueueModeView("queue", 20, 812.5, 311),
             MODELS[2]: status.QueueModeView("?")}
    processes = {"processes": [
        {"name": "worker-tidegate-sim", "pid": 4242, "running": True, "restart_pending": False,
         "restarts": 2, "last_exit_code": -9}]}
    batches = [{"id": BATCH, "tenant": "acme-research", "status": "in_progress",
                "endpoint": "/v1/chat/completions", "total": 5000, "completed": 1200,
                "failed": 3, "created_at": int(now - 600), "expires_in_s": 85800}]
    edges = {"total": {"edges": 1, "streams": 21, "ws_connections": 2, "ws_generations": 1},
             "edges": [{"edge_id": "e5c2aa07d1", "host": HOST, "pid": 4000, "uptime_s": 7400.0,
                        "heartbeat_age_s": 1.0, "streams": 21, "ws_connections": 2,
                        "ws_generations": 1, "draining": False}]}
    return status.document(config, snap(now, 900, 880, 5000), snap(now - 2, 880, 860, 4950),
                           modes, processes, batches, edges)


def section(view: str, title: str) -> list[str]:
    """The lines of one table after its title, up to the blank line before
    the next table's title (the blank lines between its panels stay)."""
    lines = [*view.splitlines(), ""]
    start = next(i for i, line in enumerate(lines) if line.startswith(title))
    end = next(i for i in range(start + 1, len(lines))
               if not lines[i] and (i + 1 == len(lines) or _is_title(lines[i + 1])))
    return lines[start + 1:end]


def _is_title(line: str) -> bool:
    return line.split(":")[0] in ("Models", "Replicas", "Workers", "Edges", "Batches",
                                  "Processes (tidegate up)")


def values(doc: dict[str, Any]) -> list[str]:
    """What a reader needs from the view, as the view spells it."""
    out = [*MODELS, *WORKER_IDS, HOST, BATCH, "acme-research", "e5c2aa07d1",
           "http://10.0.0.5:8000", "http://10.0.0.6:8000", "worker-tidegate-sim",
           "812 ms", "12m34s", "1234", "311", "17/24 auto", "(draining)", "78% of 40",
           "1203/5000", "85800s", "in_progress", "2h01m", str(doc["dispatch_backlog"])]
    return out


@pytest.mark.parametrize("width", [80, 200])
def test_every_line_fits_and_nothing_is_cut(width: int) -> None:
    doc = sample()
    view = status_view.render(doc, width)
    lines = view.splitlines()
    too_long = [line for line in lines if len(line) > width]
    assert not too_long, too_long
    assert "…" not in view
    assert "..." not in view
    missing = [v for v in values(doc) if v not in view]
    assert not missing, f"{missing} not in\n{view}"


def test_80_columns_finds_each_models_numbers_by_its_name() -> None:
    """At 80 columns the Models table is stacked into panels, each led by the
    model's full name: the reader finds a model's mode and queue by name."""
    view = status_view.render(sample(), 80)
    models = section(view, "Models")
    assert all(len(line) <= 80 for line in models)
    for name, mode, waiting in ((MODELS[0], "normal", "0"), (MODELS[1], "queue", "1234"),
                                (MODELS[2], "?", "5")):
        rows = [line.split() for line in models if line.startswith(name + " ")]
        assert len(rows) >= 2, (name, models)  # one per panel
        assert any(mode in row for row in rows), (name, mode, models)
        assert any(waiting in row for row in rows), (name, waiting, models)


def test_200_columns_keeps_one_line_per_row_with_full_headers() -> None:
    view = status_view.render(sample(), 200)
    models = section(view, "Models")
    header = models[0]
    for column in ("model", "workers", "slots used/total", "waiting", "running", "oldest",
                   "mode", "limit", "p99 TTFT", "held", "started/s", "finished/s"):
        assert column in header, header
    assert len(models) == 2 + len(MODELS), models  # header, rule, one line per model
    row = next(line for line in models if line.startswith(MODELS[1]))
    assert row.split()[1:] == ["1", "17/24", "auto", "1234", "17", "12m34s", "queue", "20",
                               "812", "ms", "311", "20", "10"], row


def test_json_is_the_document_the_view_draws() -> None:
    """``--json`` prints :func:`status.document` as it is: the view adds no
    field and the document drops none (the key sets as they were before the
    view stopped using rich)."""
    doc = sample()
    assert set(doc) == {"taken", "nats", "dispatch_backlog", "requests_per_s", "models",
                        "workers", "processes", "batches", "edges"}
    assert set(doc["models"][0]) == {"model", "replicas", "workers", "slots", "adaptive",
                                     "queue", "queue_mode", "rates"}


@pytest.mark.parametrize("width", [20, 30, 44, 60])
def test_narrow_terminals_stack_rows_and_still_show_everything(width: int) -> None:
    doc = sample()
    view = status_view.render(doc, width)
    assert all(len(line) <= width for line in view.splitlines()), view
    # A value wider than its column wraps after "/" or "," or at a space, so
    # each of those pieces is on one line; only a piece longer than the
    # whole line (the batch id at 20 columns) is broken inside.
    flat = "".join(view.split())
    missing = [piece for v in values(doc) for piece in re.split(r"(?<=[/,])|\s+", v)
               if piece and piece not in flat
               and not (len(piece) > width // 2
                        and all(piece[k:k + 8] in flat for k in range(0, len(piece), 8)))]
    assert not missing, f"{missing} not in\n{view}"


def test_table_layouts_in_order() -> None:
    """One line per row with full headers; then short headers; then wrapped
    cells or panels led by the key column; never a cut cell."""
    table = Table("T", (Column("name", wrap=True), Column("number", "n", right=True),
                        Column("state")))
    table.add("alpha/beta-gamma", 12345, "running")
    assert render_table(table, 80) == ["T", "name              number  state",
                                       "----------------  ------  -------",
                                       "alpha/beta-gamma   12345  running"]
    assert render_table(table, 32) == ["T", "name                  n  state",
                                       "----------------  -----  -------",
                                       "alpha/beta-gamma  12345  running"]
    assert render_table(table, 24) == ["T", "name              number",
                                       "----------------  ------",
                                       "alpha/beta-gamma   12345",
                                       "",
                                       "name             state",
                                       "---------------  -------",
                                       "alpha/           running",
                                       "beta-gamma"]


def test_no_rows_prints_the_empty_line() -> None:
    table = Table("Workers", (Column("worker"),), empty="no live workers")
    assert render_table(table, 80) == ["Workers", "  no live workers"]


@given(st.text(alphabet=st.sampled_from("ab/, -"), max_size=60), st.integers(1, 30))
def test_wrap_keeps_every_character(text: str, width: int) -> None:
    lines = wrap(text, width)
    assert all(len(line) <= width for line in lines)
    assert "".join(lines).replace(" ", "") == text.replace(" ", "")


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_terminal_is_redrawn_in_place_and_a_tall_frame_loses_rows_not_cells() -> None:
    term = _Terminal()
    screen = status._Screen(term, width=80, rows=24)
    view = status_view.render(sample(), 80)
    screen.frame(view)
    screen.frame(view)
    first, second = term.getvalue().split("\x1b[H")[1:]
    assert first == second
    shown = first.removesuffix("\x1b[J").split("\x1b[K\n")[:-1]
    assert len(shown) == 23  # a 24th newline would scroll the frame's top away
    hidden = len(view.splitlines()) - 22
    assert shown[-1].startswith(f"(+{hidden} lines"), shown[-1]
    assert shown[:-1] == view.splitlines()[:22]
    # A frame that fits is drawn whole.
    term = _Terminal()
    status._Screen(term, width=200, rows=200).frame(view)
    assert term.getvalue().split("\x1b[K\n")[:-1] == ["\x1b[H" + view.splitlines()[0],
                                                       *view.splitlines()[1:]]


def test_held_requests_show_their_classes_when_any_is_not_interactive() -> None:
    from fleet.run.status_view import held

    def qm(queued: int, **by_class: int) -> dict[str, object]:
        return {"queued": queued, "queued_by_class": by_class}

    assert held(qm(0)) == "0"
    assert held(qm(5, interactive=5, background=0, batch=0)) == "5"
    assert held(qm(4, interactive=1, background=0, batch=3)) == "4 (i1 b3)"
    assert held(qm(2, background=2)) == "2 (bg2)"
    assert held({"queued": 3}) == "3"  # a document from before classes were counted
