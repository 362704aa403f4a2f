"""The <P>_EDGES registry's entries and summary (tidegate.control.edges_registry)."""

from __future__ import annotations

from tidegate.control.edges_registry import EdgeInfo, local_info, summary


def test_entry_round_trips() -> None:
    info = local_info("e1", 100.0, streams=3, ws_connections=2, ws_generations=5,
                      draining=True)
    assert EdgeInfo.decode(info.encode()) == info


def test_old_entries_decode_with_defaults() -> None:
    assert EdgeInfo.decode(b'{"edge_id": "e"}') == EdgeInfo("e")


def test_summary_totals() -> None:
    edges = [EdgeInfo("a", streams=2, ws_connections=1, ws_generations=2, started=10.0,
                      updated=19.0),
             EdgeInfo("b", streams=1, ws_connections=3, ws_generations=0, started=15.0,
                      updated=20.0)]
    doc = summary(edges, now=20.0)
    assert doc["total"] == {"edges": 2, "streams": 3, "ws_connections": 4, "ws_generations": 2}
    assert doc["edges"][0]["uptime_s"] == 10.0
    assert doc["edges"][0]["heartbeat_age_s"] == 1.0
