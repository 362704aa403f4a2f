"""Where a stream's first token waits, hop by hop.

    python -m bench.hops --concurrency 50,200 [--window 8] [--sample 0.2]

(a)'s closed loop on tidegate's defaults with a sampled share of requests
traced to ``bench.otlp_sink --keep``, a fresh stack per concurrency. Each traced
request's time to first token splits along its spans: ``edge_to_dispatcher``,
``dispatch``, ``dispatcher_to_worker``, ``worker_to_first_token`` (the backend
call) and ``first_token_to_edge``. Each process's run-queue wait over the window
is printed beside them: a hop that waited for a core is the machine's, not the
design's. Tracing costs CPU of its own; the overhead figures are (a)'s.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import urllib.request
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from bench.otlp_sink import ReceivedSpan

FIRST_TOKEN = "gen_ai.first_token"  # tidegate.telemetry.tracing.FIRST_TOKEN_EVENT
HOPS = ("edge_to_dispatcher", "dispatch", "dispatcher_to_worker", "worker_to_first_token",
        "first_token_to_edge", "total")
_SERVER, _CLIENT = 2, 3  # OTLP SpanKind


def _event(span: ReceivedSpan, name: str) -> int | None:
    for (event, _), at in zip(span.events, span.event_ns, strict=False):
        if event == name:
            return at
    return None


def request_hops(spans: Iterable[ReceivedSpan]) -> dict[str, float] | None:
    """One trace's hops in ms, or None when a span or a first token is
    missing (a request that failed, or a trace cut by the window's end)."""
    edge = dispatch = job = None
    for s in spans:
        if s.kind == _SERVER and s.service.endswith("edge"):
            edge = s
        elif s.name.startswith("dispatch "):
            dispatch = s
        elif s.kind == _CLIENT and s.service.endswith("worker") and (
                job is None or s.start_ns < job.start_ns):
            job = s  # the first attempt's
    if edge is None or dispatch is None or job is None:
        return None
    edge_first, job_first = _event(edge, FIRST_TOKEN), _event(job, FIRST_TOKEN)
    if edge_first is None or job_first is None:
        return None
    marks = (edge.start_ns, dispatch.start_ns, dispatch.end_ns, job.start_ns, job_first,
             edge_first)
    hops = {name: (b - a) / 1e6 for name, a, b in zip(HOPS, marks, marks[1:], strict=False)}
    hops["total"] = (edge_first - edge.start_ns) / 1e6
    return hops


def hop_waits(spans: Iterable[ReceivedSpan], skip_s: float = 0.0) -> dict[str, Any]:
    """Every complete trace's hops (:func:`request_hops`), as p50 / p99 /
    mean ms per hop; traces whose request began in the first ``skip_s``
    seconds of the earliest one (a warm-up) left out."""
    traces: dict[str, list[ReceivedSpan]] = {}
    for s in spans:
        traces.setdefault(s.trace_id, []).append(s)
    rows = [(min(s.start_ns for s in group), request_hops(group)) for group in traces.values()]
    kept = [h for _, h in rows if h is not None]
    if skip_s and rows:
        first = min(start for start, _ in rows)
        kept = [h for start, h in rows if h is not None and start >= first + skip_s * 1e9]
    out: dict[str, Any] = {"requests": len(kept), "traces": len(traces), "hops": {}}
    for hop in HOPS:
        values = sorted(h[hop] for h in kept)
        if values:
            out["hops"][hop] = {"p50": round(statistics.median(values), 2),
                                "p99": round(values[min(len(values) - 1,
                                                        int(0.99 * len(values)))], 2),
                                "mean": round(statistics.fmean(values), 2)}
    return out


def _one(concurrency: int, window: float, warmup: float, sample: float) -> dict[str, Any]:
    """One traced run at ``concurrency`` on a fresh stack: the hops and the
    processes' run-queue waits."""
    from bench import overhead_bench, run_async, scenarios
    from bench.targets import Targets
    from bench.telemetry_bench import telemetry_env

    profile = dataclasses.replace(scenarios.FULL, concurrencies=(concurrency,),
                                  duration=window, warmup=warmup)
    with Targets(Path(tempfile.mkdtemp(prefix="tidegate-hops-"))) as env:
        env.start_fake()
        _, sink_url = env.start_otlp_sink(keep=True)
        tier_env = telemetry_env("traced", sink_url)
        tier_env.update(OTEL_TRACES_SAMPLER="parentbased_traceidratio",
                        OTEL_TRACES_SAMPLER_ARG=str(sample))
        target = env.start_tidegate("hops", tier_env)
        run = run_async(overhead_bench._load_run(target, profile, "closed", concurrency, None))
        env.stop_stack("hops")  # SIGTERM: the tiers flush the spans still queued
        with urllib.request.urlopen(f"{sink_url}/spans", timeout=60) as resp:
            spans = [ReceivedSpan(**{**d, "events": tuple(tuple(e) for e in d["events"]),
                                     "event_ns": tuple(d["event_ns"])})
                     for d in json.loads(resp.read())]
    hops = hop_waits(spans, skip_s=warmup)
    hops.update(concurrency=concurrency, sample=sample, ttft_ms=profile.ttft * 1000,
                runqueue_wait_s=run.get("runqueue_wait_s"), cpu_s=run.get("cpu_s"),
                window_s=window, errors=run.get("error_count"))
    return hops


def summary(result: dict[str, Any]) -> str:
    lines = [f"{result['concurrency']} streams: {result['requests']} traced requests "
             f"(sample {result['sample']}), the fake's TTFT {result['ttft_ms']:.0f} ms"]
    for hop, row in result["hops"].items():
        lines.append(f"  {hop:>22}  p50 {row['p50']:8.2f}  p99 {row['p99']:8.2f}  "
                     f"mean {row['mean']:8.2f} ms")
    waits = result.get("runqueue_wait_s") or {}
    lines.append("  run-queue wait over the window (s): "
                 + ", ".join(f"{k} {v}" for k, v in waits.items()))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.hops",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", default="50,200",
                        help="comma-separated stream counts, one fresh stack each")
    parser.add_argument("--window", type=float, default=8.0, help="measured seconds")
    parser.add_argument("--warmup", type=float, default=2.0)
    parser.add_argument("--sample", type=float, default=0.2,
                        help="the share of requests traced (0 < s <= 1)")
    parser.add_argument("--json", action="store_true", help="print JSON, not a table")
    args = parser.parse_args(argv)
    if not 0 < args.sample <= 1:
        parser.error("--sample: a share above 0, at most 1")
    try:
        levels = [int(c) for c in args.concurrency.split(",")]
    except ValueError:
        parser.error("--concurrency: comma-separated whole numbers, like 50,200")
    for level in levels:
        result = _one(level, args.window, args.warmup, args.sample)
        print(json.dumps(result) if args.json else summary(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
