"""Scenario (t) of ``tidegate bench``, telemetry overhead: (a)'s closed loop on
tidegate with telemetry off, default (metrics) and traced, each on a fresh stack:
CPU per chunk and per request, and the spans each request exported."""

from __future__ import annotations

import asyncio
import json
import os
import urllib.request
from collections.abc import Mapping
from typing import Any

from bench.overhead_bench import _load_run
from bench.scenarios import Profile
from bench.targets import Targets
from fleet.run.servers import ManagedProcess

# --------------------------------------------------------------------------
# (t) telemetry overhead
# --------------------------------------------------------------------------

TELEMETRY_VARIANTS = ("off", "metrics", "traced")
_GATEWAY = ("edge", "dispatcher", "worker", "nats-server")


def telemetry_env(variant: str, sink_url: str,
                  base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The tiers' whole environment for one variant of (t): the benchmark's
    own without any ``OTEL_*`` variable, plus the variant's."""
    env = {k: v for k, v in (os.environ if base is None else base).items()
           if not k.startswith("OTEL_")}
    # The OTLP exporter (requests) honours proxy variables: keep loopback local.
    env["NO_PROXY"] = env["no_proxy"] = "127.0.0.1,localhost"
    if variant == "off":
        env["OTEL_SDK_DISABLED"] = "true"
    elif variant == "traced":
        env["OTEL_EXPORTER_OTLP_ENDPOINT"] = sink_url
        env["OTEL_TRACES_SAMPLER"] = "always_on"
    elif variant != "metrics":
        raise ValueError(f"unknown telemetry variant {variant!r}")
    return env


def _otel_environ(pid: int | None) -> dict[str, str] | None:
    """The ``OTEL_*`` variables a running process was started with."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            raw = f.read()
    except (OSError, TypeError):
        return None
    pairs = (item.decode(errors="replace").partition("=") for item in raw.split(b"\0") if item)
    return {k: v for k, _, v in pairs if k.startswith("OTEL_")}


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=10) as resp:
        body: bytes = resp.read()
        return body


def _sink_stats(url: str) -> dict[str, Any]:
    stats: dict[str, Any] = json.loads(_get(f"{url}/stats"))
    return stats


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def telemetry_summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per variant: means over its rounds (and their spread); then each
    variant's difference from ``off`` and traced's from ``metrics``."""
    per: dict[str, dict[str, Any]] = {}
    for variant in TELEMETRY_VARIANTS:
        rs = [r for r in runs if r["variant"] == variant and r.get("cpu_us_per_chunk")]
        if not rs:
            continue
        chunk = [r["cpu_us_per_chunk"] for r in rs]
        req = [r["cpu_ms_per_request"] * 1000 for r in rs if r.get("cpu_ms_per_request")]
        procs = {}
        for name in _GATEWAY:
            vals = [r["cpu_s"][name] / r["window_chunks"] * 1e6 for r in rs
                    if r["cpu_s"].get(name) is not None and r["window_chunks"]]
            if vals:
                procs[name] = round(sum(vals) / len(vals), 2)
        sink = [r["cpu_s"].get("otlp-sink") for r in rs]
        per[variant] = {
            "rounds": len(rs),
            "cpu_us_per_chunk": round(sum(chunk) / len(chunk), 2),
            "cpu_us_per_chunk_runs": chunk,
            "cpu_us_per_request": round(sum(req) / len(req), 1) if req else None,
            "cpu_us_per_request_runs": [round(v, 1) for v in req],
            "process_us_per_chunk": procs,
            "streams_per_s": round(sum(r["streams_per_s"] for r in rs) / len(rs), 1),
            "chunks_per_s": round(sum(r["chunks_per_s"] for r in rs) / len(rs), 1),
            "ttft_p50_ms": round(sum(r["ttft_ms"]["p50"] for r in rs) / len(rs), 1),
            "ttft_p99_ms": round(sum(r["ttft_ms"]["p99"] for r in rs) / len(rs), 1),
            "sink_cpu_s": (round(sum(v for v in sink if v is not None) / len(rs), 3)
                           if any(v is not None for v in sink) else None),
            "spans_per_request": _mean([r["spans_per_request"] for r in rs
                                        if r.get("spans_per_request") is not None]),
            "errors": sum(r["error_count"] for r in rs),
            "env_ok": all(r.get("env_ok") for r in rs),
        }
    deltas = []
    for variant, base in (("metrics", "off"), ("traced", "off"), ("traced", "metrics")):
        if variant not in per or base not in per:
            continue
        a, b = per[variant], per[base]
        row: dict[str, Any] = {"variant": variant, "against": base}
        row["cpu_us_per_chunk"] = round(a["cpu_us_per_chunk"] - b["cpu_us_per_chunk"], 2)
        row["cpu_us_per_chunk_pct"] = round(100 * row["cpu_us_per_chunk"]
                                            / b["cpu_us_per_chunk"], 1)
        if a["cpu_us_per_request"] is not None and b["cpu_us_per_request"] is not None:
            row["cpu_us_per_request"] = round(a["cpu_us_per_request"]
                                              - b["cpu_us_per_request"], 1)
            row["cpu_us_per_request_pct"] = round(100 * row["cpu_us_per_request"]
                                                  / b["cpu_us_per_request"], 1)
        row["process_us_per_chunk"] = {
            name: round(a["process_us_per_chunk"][name] - b["process_us_per_chunk"][name], 2)
            for name in _GATEWAY
            if name in a["process_us_per_chunk"] and name in b["process_us_per_chunk"]}
        deltas.append(row)
    return {"variants": per, "deltas": deltas}


async def _telemetry_run(env: Targets, profile: Profile, variant: str, round_: int,
                         sink: ManagedProcess, sink_url: str) -> dict[str, Any]:
    tier_env = telemetry_env(variant, sink_url)
    name = f"t-{variant}-{round_}"
    target = await asyncio.to_thread(env.start_tidegate, name, tier_env)
    try:
        target.extra["otlp-sink"] = sink
        # The tiers really run with the variant's OTEL_* variables, and nothing else.
        wanted = {k: v for k, v in tier_env.items() if k.startswith("OTEL_")}
        seen = {tier: _otel_environ(target.pids(target.cpu).get(tier))
                for tier in ("edge", "dispatcher", "worker")}
        spans_before = await asyncio.to_thread(_sink_stats, sink_url)
        run = await _load_run(target, profile, "closed", profile.telemetry_concurrency, None)
        metrics = await asyncio.to_thread(
            _get, f"http://127.0.0.1:{target.metrics_port}/metrics")
    finally:
        # SIGTERM: the tiers flush the spans still queued in their batch processors.
        await asyncio.to_thread(env.stop_stack, name)
    spans_after = await asyncio.to_thread(_sink_stats, sink_url)
    by_service = {svc: n - spans_before["spans_by_service"].get(svc, 0)
                  for svc, n in spans_after["spans_by_service"].items()}
    spans = sum(by_service.values())
    requests = run["sent"] + 1  # the readiness round trip is one more request
    run.update({
        "target": "tidegate", "stack": name, "variant": variant, "round": round_,
        "otel_env": wanted, "otel_env_seen": seen,
        "env_ok": all(v == wanted for v in seen.values()),
        "edge_metrics_bytes": len(metrics),
        "spans": spans, "spans_by_service": {k: v for k, v in by_service.items() if v},
        "spans_per_request": round(spans / requests, 2),
    })
    return run


async def telemetry_overhead(env: Targets, profile: Profile) -> dict[str, Any]:
    """(a)'s closed loop on tidegate three ways: telemetry off
    (``OTEL_SDK_DISABLED``), default (metrics, no tracing) and traced (every
    request, exported over OTLP/HTTP to a receiver in its own process). Each
    run gets a fresh stack; the order alternates between rounds so a drift of
    the machine does not land on one variant."""
    sink, sink_url = await asyncio.to_thread(env.start_otlp_sink)
    runs: list[dict[str, Any]] = []
    for r in range(profile.telemetry_rounds):
        order = TELEMETRY_VARIANTS if r % 2 == 0 else TELEMETRY_VARIANTS[::-1]
        for variant in order:
            runs.append(await _telemetry_run(env, profile, variant, r + 1, sink, sink_url))
    return {"params": {"concurrency": profile.telemetry_concurrency,
                       "rounds": profile.telemetry_rounds, "tokens": profile.tokens,
                       "itl_s": profile.itl, "ttft_s": profile.ttft,
                       "warmup_s": profile.warmup, "window_s": profile.duration,
                       "variants": {v: {k: val for k, val in telemetry_env(v, "SINK").items()
                                        if k.startswith("OTEL_")}
                                    for v in TELEMETRY_VARIANTS}},
            "runs": runs, "summary": telemetry_summary(runs)}
