"""The scenarios of ``tidegate bench``; each returns a JSON-ready dict.

(a) overhead and throughput (closed loop per concurrency, one open-loop rate);
(b) idle streams (RSS per stream, idle CPU); (c) cancel latency (client close
to the backend's close); (d) slow clients (RSS over time); (e) other gateways
(they join every scenario); (t) telemetry off / metrics / traced. The direct
target is the floor in (a) and (c); (b) and (d) skip it.

Each family has its module (``bench.overhead_bench``, ``bench.memory_bench``,
``bench.cancel_bench``, ``bench.telemetry_bench``); this one holds what they
share: a run's :class:`Profile` (``FULL``, ``QUICK``) and small helpers.
"""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass
from typing import Any

from bench.loadgen import percentile
from bench.targets import Target

__all__ = ["FULL", "QUICK", "Profile"]


@dataclass(frozen=True, slots=True)
class Profile:
    """Every knob of a run; ``FULL`` is the documented run, ``QUICK`` the CI smoke."""

    name: str
    concurrencies: tuple[int, ...]
    tokens: int
    itl: float
    ttft: float
    warmup: float
    duration: float
    open_rate: float  # arrivals per second for the open-loop point of (a)
    idle_streams: int
    idle_hold: float
    heartbeat_interval: float  # tidegate's session.heartbeat_interval in this run
    cancel_concurrency: int
    cancel_rounds: int
    cancel_after: int  # data events a client reads before it hangs up
    cancel_tokens: int
    slow_clients: int
    slow_duration: float
    slow_bytes_per_s: int
    telemetry_concurrency: int  # (t): closed-loop streams
    telemetry_rounds: int  # (t): each variant runs this many times, order alternating
    # (a)'s closed loop per concurrency, once per arrival pattern: "spread"
    # (users start over the first half of the warm-up) and "burst" (all at
    # once, as a front end after a deploy sends them).
    arrivals: tuple[str, ...] = ("spread", "burst")


FULL = Profile(
    name="full", concurrencies=(50, 200, 1000, 2000), tokens=64, itl=0.010, ttft=0.05,
    warmup=2.0, duration=8.0, open_rate=150.0,
    idle_streams=10_000, idle_hold=8.0, heartbeat_interval=5.0,
    cancel_concurrency=200, cancel_rounds=3, cancel_after=8, cancel_tokens=200,
    slow_clients=20, slow_duration=20.0, slow_bytes_per_s=4096,
    telemetry_concurrency=200, telemetry_rounds=2)

QUICK = Profile(
    name="quick", concurrencies=(10, 50), tokens=16, itl=0.010, ttft=0.02,
    warmup=0.5, duration=1.5, open_rate=30.0,
    idle_streams=100, idle_hold=1.5, heartbeat_interval=1.0,
    cancel_concurrency=50, cancel_rounds=1, cancel_after=4, cancel_tokens=100,
    slow_clients=5, slow_duration=2.0, slow_bytes_per_s=4096,
    telemetry_concurrency=20, telemetry_rounds=1)

_ids = itertools.count(1)


def _bench_id(prefix: str) -> str:
    return f"{prefix}-{next(_ids)}"


def _cdf(values: Any) -> list[float]:
    """101 quantiles (0..100 %) in ms, enough to redraw a CDF from the JSON."""
    s = sorted(values)
    return [round(percentile(s, p) * 1000, 3) for p in range(101)] if s else []


def _cpu_pids(target: Target) -> dict[str, int]:
    return {**target.pids(target.cpu), **target.pids(target.extra)}


def profile_dict(profile: Profile) -> dict[str, Any]:
    return asdict(profile)
