"""The soak (bench.soak): mixed traffic on ``tidegate up --workers 2`` with a
worker SIGKILLed along the way. The hour is recorded in docs/reliability.md;
the suite runs five minutes: every request gets its answer (or its 4xx, or
its client left), no JetStream consumer piles up, no claimed body is left."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import soak


def test_the_slope_is_a_share_of_the_mean_per_hour() -> None:
    flat = [(float(t), "edge", 7, 100_000) for t in range(0, 600, 10)]
    growing = [(float(t), "nats-server", 8, 100_000 + t * 10) for t in range(0, 600, 10)]
    restarted = [(float(t), "worker:1", 9 + t // 300, 50_000) for t in range(0, 600, 10)]
    out = soak.slopes(flat + growing + restarted, warmup=60.0)
    assert out["edge"]["slope_pct_per_hour"] == 0.0
    # 10 KiB a second on a mean of about 103,300 KiB: 34.8 % of it an hour.
    assert out["nats-server"]["slope_pct_per_hour"] == pytest.approx(
        10 * 3600 / 103_300 * 100, rel=0.01)
    assert out["worker:1"] == {"lives": 2}


def test_consumer_growth_compares_the_last_third_with_the_first() -> None:
    steady = [(float(t), 20 + t % 3) for t in range(60, 600, 10)]
    assert soak.consumer_growth(steady, warmup=60.0) == 0
    leaking = [(float(t), 20 + t // 10) for t in range(60, 600, 10)]
    assert soak.consumer_growth(leaking, warmup=60.0) > soak.CONSUMER_SLACK


@pytest.mark.slow
@pytest.mark.pipeline
@pytest.mark.timeout(900)  # five minutes of traffic, the stack's start and stop
def test_five_minutes_of_mixed_traffic_lose_nothing_and_leak_nothing(tmp_path: Path) -> None:
    report = soak.run(duration=300.0, kill_every=75.0, rate=8.0, out=tmp_path,
                      max_slope=1e9)  # RSS over five minutes is warm-up: the hour tells
    assert report["failed"] == {}, report["outcomes"]
    assert set(report["outcomes"]) == {kind for kind, _ in soak.MIX} | {"batch"}
    assert sum(report["outcomes"]["hostile"].values()) == \
        report["outcomes"]["hostile"].get("refused", 0)
    assert report["consumers"]["growth"] <= soak.CONSUMER_SLACK, report["consumers"]
    assert not report["bodies_left"]
    assert report["ok"]
    assert (tmp_path / "soak-rss.svg").read_text().startswith("<svg")
