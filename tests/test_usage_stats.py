"""tidegate.control.usage_stats without I/O: windows, groups, what counts as a
request, pruning, and the live TTFT and token rate; and the admin flag of a
key record (tidegate.control.keys)."""

from __future__ import annotations

import pytest

from tidegate.control.keys import KeyRecord
from tidegate.control.usage_stats import UsageStats, percentile
from tidegate.errors import ProtocolError
from tidegate.wire.protocol import UsageRecord

NOW = 1_800_000_000.0  # a minute and an hour boundary


def rec(tenant: str = "acme", key: str = "k1", model: str = "m", outcome: str = "done",
        prompt: int = 10, completion: int = 20, ttft: float = 100.0) -> UsageRecord:
    return UsageRecord(id="r", model=model, outcome=outcome, tenant=tenant, key_id=key,
                       prompt_tokens=prompt, completion_tokens=completion, ttft_ms=ttft)


def test_windows_group_by_tenant_key_and_model() -> None:
    stats = UsageStats()
    stats.add(rec(), NOW - 30)
    stats.add(rec(key="k2", model="n", outcome="error", completion=0), NOW - 90)
    stats.add(rec(tenant="beta", key="k3"), NOW - 7200)  # two hours ago
    stats.add(rec(tenant="beta", key="k3"), NOW - 10 * 86400)  # ten days ago
    stats.add(rec(outcome="dropped"), NOW - 10)  # a job no worker ran: no request
    hour = stats.report("hour", NOW)
    assert hour["total"] == {"requests": 2, "prompt_tokens": 20, "completion_tokens": 20,
                             "errors": 1}
    assert hour["by_tenant"] == [{"tenant": "acme", "requests": 2, "prompt_tokens": 20,
                                  "completion_tokens": 20, "errors": 1}]
    assert {r["key_id"]: r["requests"] for r in hour["by_key"]} == {"k1": 1, "k2": 1}
    assert {r["model"]: r["errors"] for r in hour["by_model"]} == {"m": 0, "n": 1}
    day = stats.report("day", NOW)
    assert {r["tenant"]: r["requests"] for r in day["by_tenant"]} == {"acme": 2, "beta": 1}
    month = stats.report("month", NOW)
    assert {r["tenant"]: r["requests"] for r in month["by_tenant"]} == {"acme": 2, "beta": 2}
    assert month["by_key"][0]["tenant"] in ("acme", "beta")
    assert stats.records == 5


def test_prune_keeps_what_the_windows_need() -> None:
    stats = UsageStats()
    stats.add(rec(), NOW - 2 * 86400)
    stats.add(rec(), NOW - 40 * 86400)
    stats.prune(NOW)
    assert stats.report("day", NOW)["total"]["requests"] == 0
    assert stats.report("month", NOW)["total"]["requests"] == 1  # 40 days ago: gone
    assert all(start >= NOW - 86400 - 60 for start in stats.minutes)
    assert len(stats.hours) == 1  # two days ago: still in the month


def test_live_ttft_and_tokens_per_second() -> None:
    stats = UsageStats()
    for i in range(100):
        stats.add(rec(ttft=float(i + 1), completion=6), NOW - 30)
    stats.add(rec(ttft=5000.0, completion=600), NOW - 120)  # outside the last minute
    stats.add(rec(model="n", ttft=0.0, completion=60), NOW - 5)  # no first token time
    live = stats.live(NOW)
    assert live["m"] == {"ttft_p50_ms": 50.0, "ttft_p99_ms": 99.0, "tokens_per_s": 10.0}
    assert live["n"] == {"ttft_p50_ms": None, "ttft_p99_ms": None, "tokens_per_s": 1.0}
    assert percentile([], 50) is None


def test_an_admin_flag_is_stored_only_when_set_and_must_be_a_boolean() -> None:
    tenant = KeyRecord(key_id="a" * 12, tenant="acme")
    admin = KeyRecord(key_id="b" * 12, tenant="ops", admin=True)
    assert b"admin" not in tenant.encode()
    assert KeyRecord.decode(admin.encode()).admin is True
    assert KeyRecord.decode(tenant.encode()).admin is False
    with pytest.raises(ProtocolError):
        KeyRecord.decode(admin.encode().replace(b"true", b'"yes"'))
