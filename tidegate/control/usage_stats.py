"""Usage by tenant, key and model over an hour, a day and a month, and recent TTFT
and token rate per model (sans-I/O, fed ``<P>_USAGE`` records by the console).

Invariant: memory is bounded: one bucket per minute for the last day and one
per hour for the last 31 days; a window sums whole buckets. Every record of a
job that ran counts as a request (``done``, ``error``, ``cancelled``);
``dropped`` records count nothing; a redelivered job that ran twice counts
twice, as it was charged twice. Docs: docs/console.md.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Any

from tidegate.wire.protocol import UsageRecord

WINDOWS: dict[str, float] = {"hour": 3600.0, "day": 86400.0, "month": 30 * 86400.0}
MINUTE, HOUR = 60, 3600
RECENT = 300.0  # seconds of per-record timings kept for the live TTFT and token rate

_FIELDS = ("requests", "prompt_tokens", "completion_tokens", "errors")


@dataclass(frozen=True, slots=True)
class Recent:
    at: float
    model: str
    ttft_ms: float
    completion_tokens: int


def _empty() -> list[int]:
    return [0, 0, 0, 0]


class UsageStats:
    """Sums of requests, tokens and errors per (tenant, key id, model)."""

    def __init__(self) -> None:
        # bucket start (Unix seconds) -> (tenant, key_id, model) -> sums (_FIELDS)
        self.minutes: dict[int, dict[tuple[str, str, str], list[int]]] = {}
        self.hours: dict[int, dict[tuple[str, str, str], list[int]]] = {}
        self.recent: deque[Recent] = deque()
        self.records = 0  # every record seen, dropped ones included
        self.last_at = 0.0

    def add(self, record: UsageRecord, at: float) -> None:
        """One record, published at ``at`` (the stream's timestamp)."""
        self.records += 1
        self.last_at = max(self.last_at, at)
        if record.outcome == "dropped":
            return
        scope = (record.tenant, record.key_id or "-", record.model)
        adds = (1, record.prompt_tokens, record.completion_tokens,
                0 if record.outcome in ("done", "cancelled") else 1)
        for buckets, size in ((self.minutes, MINUTE), (self.hours, HOUR)):
            sums = buckets.setdefault(int(at // size) * size, {}).setdefault(scope, _empty())
            for i, value in enumerate(adds):
                sums[i] += value
        self.recent.append(Recent(at, record.model, record.ttft_ms, record.completion_tokens))

    def prune(self, now: float) -> None:
        """Forget minute buckets older than a day and hour buckets older than 31 days."""
        for buckets, keep in ((self.minutes, WINDOWS["day"] + MINUTE),
                              (self.hours, WINDOWS["month"] + 86400.0 + HOUR)):
            for start in [s for s in buckets if s < now - keep]:
                del buckets[start]
        while self.recent and self.recent[0].at < now - RECENT:
            self.recent.popleft()

    def report(self, window: str, now: float) -> dict[str, Any]:
        """Sums over ``window`` (``hour``, ``day`` or ``month``) by tenant, by
        key (with its tenant) and by model, largest first, and the total."""
        span = WINDOWS[window]
        buckets, size = (self.hours, HOUR) if window == "month" else (self.minutes, MINUTE)
        since = int((now - span) // size) * size + size
        total = _empty()
        groups: dict[str, dict[tuple[str, ...], list[int]]] = {"tenant": {}, "key": {},
                                                                "model": {}}
        for start, scopes in buckets.items():
            if start < since:
                continue
            for (tenant, key_id, model), sums in scopes.items():
                for name, group in (("tenant", (tenant,)), ("key", (key_id, tenant)),
                                    ("model", (model,))):
                    row = groups[name].setdefault(group, _empty())
                    for i, value in enumerate(sums):
                        row[i] += value
                for i, value in enumerate(sums):
                    total[i] += value

        def rows(name: str, keys: tuple[str, ...]) -> list[dict[str, Any]]:
            out = [{**dict(zip(keys, group, strict=True)), **dict(zip(_FIELDS, sums, strict=True))}
                   for group, sums in groups[name].items()]
            return sorted(out, key=lambda r: (-r["requests"], *(r[k] for k in keys)))

        return {"window": window, "since": since, "until": now,
                "total": dict(zip(_FIELDS, total, strict=True)),
                "by_tenant": rows("tenant", ("tenant",)),
                "by_key": rows("key", ("key_id", "tenant")),
                "by_model": rows("model", ("model",))}

    def live(self, now: float, span: float = 60.0) -> dict[str, dict[str, float | None]]:
        """Per model over the last ``span`` seconds of finished requests: TTFT
        p50 and p99 (ms; None without a request that had one) and output
        tokens per second (tokens of requests that finished in the span)."""
        ttfts: dict[str, list[float]] = {}
        tokens: dict[str, int] = {}
        for r in self.recent:
            if r.at < now - span:
                continue
            tokens[r.model] = tokens.get(r.model, 0) + r.completion_tokens
            if r.ttft_ms > 0:
                ttfts.setdefault(r.model, []).append(r.ttft_ms)
        return {model: {"ttft_p50_ms": percentile(ttfts.get(model, []), 50),
                        "ttft_p99_ms": percentile(ttfts.get(model, []), 99),
                        "tokens_per_s": round(count / span, 2)}
                for model, count in tokens.items()}


def percentile(values: list[float], p: float) -> float | None:
    """The nearest-rank ``p``-th percentile; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(p / 100 * len(ordered)))
    return round(ordered[rank - 1], 1)
