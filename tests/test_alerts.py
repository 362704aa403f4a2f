"""deploy/: the Prometheus alert rules and the Grafana dashboard.

* ``promtool check rules`` and ``promtool test rules`` (the unit tests in
  deploy/prometheus/alerts_test.yml), where promtool is installed (Debian:
  ``apt-get install prometheus``); skipped, saying so, where it is not.
* Without promtool: every metric and label name the rules and the dashboard
  use is one tidegate actually exports, so a renamed instrument cannot leave
  an alert silently watching nothing.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tidegate.telemetry import telemetry
from tidegate.telemetry import telemetry as tm
from tidegate.telemetry.telemetry import TelemetrySettings

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
RULES = DEPLOY / "prometheus" / "alerts.yml"
RULES_TEST = DEPLOY / "prometheus" / "alerts_test.yml"
DASHBOARD = DEPLOY / "grafana" / "tidegate.json"

# Names PromQL or Grafana define, not tidegate.
_NOT_OURS = {"le", "instance", "job", "severity"}


def _promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.skip("promtool is not installed (Debian: apt-get install prometheus)")
    return path


def test_promtool_checks_the_rules() -> None:
    done = subprocess.run([_promtool(), "check", "rules", str(RULES)], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout


def test_promtool_unit_tests_of_the_rules() -> None:
    done = subprocess.run([_promtool(), "test", "rules", str(RULES_TEST)], capture_output=True,
                          text=True, timeout=60, cwd=RULES_TEST.parent)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.fixture(scope="module")
def exported() -> set[str]:
    """Every sample and label name of a process that recorded each instrument once."""
    telemetry.reset()
    tel = telemetry.setup(TelemetrySettings.from_env("test", {}))
    attrs = {tm.MODEL: "m", tm.OUTCOME: "o", tm.ERROR_TYPE: "e", tm.TOKEN_TYPE: "input",
             tm.CAUSE: "c", tm.TIER: "t", tm.LIMIT: "l", tm.SLOT_STATE: "used",
             tm.OPERATION: "chat", tm.REQUEST_CLASS: "interactive"}
    m = tel.metrics
    for instrument in vars(m).values():
        for method in ("record", "add", "set"):
            if hasattr(instrument, method):
                getattr(instrument, method)(1, attrs)
                break
    m.observe_worker_slots(lambda: [(1.0, attrs)])
    m.observe_edge(lambda: 1, lambda: 1)
    m.observe_queues(*(lambda: [(1.0, attrs)] for _ in range(6)))
    names: set[str] = set()
    for family in text_string_to_metric_families(tel.exposition()[0].decode()):
        for sample in family.samples:
            names.add(sample.name)
            names.update(sample.labels)
    telemetry.reset()
    return names


def _identifiers(expr: str) -> set[str]:
    # Strip quoted label values first: "tidegate_outcome" can be a value too.
    unquoted = re.sub(r'"[^"]*"', '""', expr)
    return set(re.findall(r"\b(?:tidegate|gen_ai|error)_[a-z_]+\b", unquoted))


def _rule_exprs() -> list[str]:
    text = RULES.read_text()
    exprs: list[str] = []
    for match in re.finditer(r"expr: (\|\n(?P<block>(?:          .*\n|\n)+)|(?P<line>.*))", text):
        exprs.append(match["block"] or match["line"])
    return exprs


def _dashboard_exprs(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("expr", "definition") and isinstance(value, str):
                yield value
            else:
                yield from _dashboard_exprs(value)
    elif isinstance(node, list):
        for item in node:
            yield from _dashboard_exprs(item)


def test_rules_use_exported_names(exported: set[str]) -> None:
    exprs = _rule_exprs()
    assert len(exprs) >= 6
    used = set().union(*map(_identifiers, exprs)) - _NOT_OURS
    assert used, exprs
    assert used <= exported, sorted(used - exported)


def test_dashboard_is_valid_and_uses_exported_names(exported: set[str]) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] == "tidegate-overview"
    assert dashboard["title"] == "tidegate"
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    assert len(panels) >= 15
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
    for panel in panels:
        assert panel["targets"], panel["title"]
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]
    exprs = list(_dashboard_exprs(dashboard))
    used = set().union(*map(_identifiers, exprs)) - _NOT_OURS
    assert used <= exported, sorted(used - exported)
    # The signals issue 5 asks for are all on it.
    for name in ("gen_ai_server_time_to_first_token_seconds_bucket", "tidegate_queue_depth",
                 "tidegate_queue_oldest_age_seconds", "tidegate_queue_mode_active",
                 "tidegate_quota_rejections_total", "tidegate_flow_stall_duration_seconds_sum",
                 "tidegate_cancellations_total", "tidegate_redeliveries_total",
                 "tidegate_workers_slots", "tidegate_edge_streams_active",
                 "tidegate_edge_connections_active", "gen_ai_client_token_usage_sum"):
        assert name in used, name
