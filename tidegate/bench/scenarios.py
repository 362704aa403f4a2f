"""The scenarios of ``tidegate bench``; each returns a JSON-ready dict.

(a) overhead and throughput   closed loop at each concurrency, plus one
                              open-loop (Poisson) rate, on every target
(b) idle stream capacity      N streams held open, heartbeats only: RSS per
                              stream and idle CPU
(c) cancel latency            clients close mid-stream; time from client
                              close to the fake backend seeing its close
(d) slow clients              clients reading a few KiB/s: RSS over time
(e) other gateways            the plain proxy (and LiteLLM) join every
                              scenario above
(t) telemetry overhead        (a)'s closed loop on tidegate with telemetry
                              off, default (metrics) and traced, each on a
                              fresh stack: CPU per chunk and per request

The direct target (the fake backend itself) is the floor in (a) and (c);
(b) and (d) are about the memory of a gateway, so they skip it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import json
import os
import time
import urllib.request
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from tidegate.bench import loadgen, procstats
from tidegate.bench.loadgen import (
    Recorder,
    chat_body,
    distribution,
    new_session,
    percentile,
    responses_body,
)
from tidegate.bench.profiling import PySpy
from tidegate.bench.targets import Target, Targets
from tidegate.run.servers import ManagedProcess

__all__ = ["FULL", "QUICK", "Profile", "cancel", "idle", "overhead", "slow_clients",
           "telemetry_overhead"]


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


# --------------------------------------------------------------------------
# (a) overhead and throughput
# --------------------------------------------------------------------------


async def _load_run(target: Target, profile: Profile, mode: str, load: float,
                    spy: PySpy | None, api: str = "chat",
                    arrival: str = "spread") -> dict[str, Any]:
    """One load level on one target; ``api`` "responses" streams the Responses
    API instead of chat (``tidegate.bench.responses_bench``); ``arrival``
    "burst" starts a closed loop's users all at once instead of spread."""
    endpoint = target.endpoint
    make: Callable[..., bytes] = chat_body
    if api == "responses":
        endpoint, make = dataclasses.replace(endpoint, path="/responses"), responses_body
    rec = Recorder()
    rec.cpu = procstats.CpuWindow(_cpu_pids(target))

    def body() -> bytes:
        return make(endpoint.model, tokens=profile.tokens, itl=profile.itl, ttft=profile.ttft)

    async with new_session() as session, contextlib.AsyncExitStack() as stack:
        if spy is not None:
            await stack.enter_async_context(
                spy.window(target, profile.warmup, profile.duration, f"{mode}{load:g}"))
        if mode == "closed":
            await loadgen.closed_loop(session, endpoint, body, rec, concurrency=int(load),
                                      warmup=profile.warmup, duration=profile.duration,
                                      ramp=0.0 if arrival == "burst" else None)
        else:
            await loadgen.open_loop(session, endpoint, body, rec, rate=load,
                                    warmup=profile.warmup, duration=profile.duration)
    result: dict[str, Any] = {"target": target.name, "api": api, "mode": mode,
                              ("concurrency" if mode == "closed" else "rate"): load,
                              **({"arrival": arrival} if mode == "closed" else {}),
                              **rec.summary(), "ttft_cdf_ms": _cdf(rec.ttft)}
    window = rec.t1 - rec.t0
    used = rec.cpu.used or {}
    result["cpu_s"] = {k: None if v is None else round(v, 3) for k, v in used.items()}
    result["runqueue_wait_s"] = {k: None if v is None else round(v, 3)
                                 for k, v in (rec.cpu.waited or {}).items()}
    result["loadgen_cpu_s"] = round(rec.cpu.self_used, 3)
    known = [v for v in used.values() if v is not None]
    result["machine_cores_busy"] = round((sum(known) + rec.cpu.self_used) / window, 2)
    if target.cpu:
        gateway = [used.get(name) for name in target.cpu]
        if all(v is not None for v in gateway):
            total = sum(v for v in gateway if v is not None)
            result["gateway_cpu_s"] = round(total, 3)
            chunks, done = rec.window_chunks, rec.window_completed
            result["cpu_us_per_chunk"] = round(total / chunks * 1e6, 1) if chunks else None
            result["cpu_ms_per_request"] = round(total / done * 1e3, 2) if done else None
    return result


def _add_ratios(runs: list[dict[str, Any]]) -> None:
    """TTFT overhead and throughput ratio of each run against direct at the same load."""
    def key(r: dict[str, Any]) -> tuple[Any, ...]:
        return r["mode"], r.get("concurrency", r.get("rate")), r.get("arrival")

    floor = {key(r): r for r in runs if r["target"] == "direct"}
    for r in runs:
        base = floor.get(key(r))
        if base is None or r is base:
            continue
        ours, theirs = r["ttft_ms"], base["ttft_ms"]
        if ours.get("count") and theirs.get("count"):
            r["ttft_overhead_ms"] = {p: round(ours[p] - theirs[p], 3) for p in ("p50", "p99")}
        if base["streams_per_s"]:
            r["throughput_ratio"] = round(r["streams_per_s"] / base["streams_per_s"], 3)
        if base["chunks_per_s"]:
            r["chunks_ratio"] = round(r["chunks_per_s"] / base["chunks_per_s"], 3)


async def overhead(targets: list[Target], profile: Profile,
                   spy: PySpy | None = None) -> dict[str, Any]:
    runs: list[dict[str, Any]] = []
    profiled = min(profile.concurrencies, key=lambda c: abs(c - 200))
    for c in profile.concurrencies:
        for arrival in profile.arrivals:
            for target in targets:
                use_spy = spy if (target.name == "tidegate" and c == profiled
                                  and arrival == profile.arrivals[0]) else None
                runs.append(await _load_run(target, profile, "closed", c, use_spy,
                                            arrival=arrival))
    for target in targets:
        runs.append(await _load_run(target, profile, "open", profile.open_rate, None))
    _add_ratios(runs)
    return {"params": {"concurrencies": list(profile.concurrencies),
                       "arrivals": list(profile.arrivals), "tokens": profile.tokens,
                       "itl_s": profile.itl, "ttft_s": profile.ttft,
                       "warmup_s": profile.warmup, "window_s": profile.duration,
                       "open_rate_per_s": profile.open_rate},
            "runs": runs}


# --------------------------------------------------------------------------
# (b) idle stream capacity
# --------------------------------------------------------------------------


def _rss(target: Target) -> dict[str, int | None]:
    return {name: procstats.rss_kib(pid) for name, pid in target.pids(target.memory).items()}


async def _idle_run(target: Target, profile: Profile) -> dict[str, Any]:
    n = profile.idle_streams
    endpoint = target.endpoint
    body = chat_body(endpoint.model, tokens=1, itl=0.0, ttft=3600.0)
    before = _rss(target)
    statuses: dict[str, int] = {}
    opened = 0
    pings = 0
    progress = asyncio.Event()

    async def hold(session: Any) -> None:
        nonlocal opened, pings
        try:
            async with session.post(endpoint.chat_url, data=body,
                                    headers=endpoint.headers) as resp:
                key = str(resp.status)
                statuses[key] = statuses.get(key, 0) + 1
                opened += 1
                progress.set()
                if resp.status != 200:
                    return
                async for data in resp.content.iter_any():
                    pings += data.count(b": ping")
        except (OSError, TimeoutError) as exc:  # aiohttp.ClientError is an OSError
            key = type(exc).__name__
            statuses[key] = statuses.get(key, 0) + 1
            opened += 1
            progress.set()

    tasks: list[asyncio.Task[None]] = []
    async with new_session(timeout=3600.0) as session:
        started = time.monotonic()
        try:
            # Paced connects (listen backlogs are finite), not gated on the
            # response headers: a gateway may send those only with its first
            # keep-alive, one heartbeat interval later.
            batch, pace = 100, 0.1
            for first in range(0, n, batch):
                tasks += [asyncio.create_task(hold(session))
                          for _ in range(min(batch, n - first))]
                await asyncio.sleep(pace)
            deadline = time.monotonic() + 2 * profile.heartbeat_interval + max(10.0, n / 200)
            while opened < n and time.monotonic() < deadline:
                progress.clear()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(1.0):
                        await progress.wait()
            open_s = time.monotonic() - started
            await asyncio.sleep(0.5)  # let allocations settle
            held_rss = _rss(target)
            cpu = procstats.CpuWindow(_cpu_pids(target))
            pings_before = pings
            cpu.start()
            hold_s = max(profile.idle_hold, 1.5 * profile.heartbeat_interval)
            await asyncio.sleep(hold_s)
            used = cpu.stop()
            pings_during = pings - pings_before
            held_rss_end = _rss(target)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    await asyncio.sleep(1.0)
    after = _rss(target)
    ok = statuses.get("200", 0)
    per_stream = {name: (round((held_rss[name] - b) / ok, 2)  # type: ignore[operator]
                         if ok and b is not None and held_rss[name] is not None else None)
                  for name, b in before.items()}
    return {"target": target.name, "streams": n, "open_ok": ok, "statuses": statuses,
            "open_s": round(open_s, 2), "hold_s": hold_s, "pings_during_hold": pings_during,
            "rss_kib": {name: {"before": before[name], "held": held_rss[name],
                               "held_end": held_rss_end[name], "after_close": after[name]}
                        for name in before},
            "rss_per_stream_kib": per_stream,
            "idle_cpu_cores": {k: None if v is None else round(v / hold_s, 3)
                               for k, v in used.items()}}


async def idle(targets: list[Target], profile: Profile) -> dict[str, Any]:
    runs = [await _idle_run(t, profile) for t in targets if t.memory]
    return {"params": {"streams": profile.idle_streams,
                       "heartbeat_interval_s": profile.heartbeat_interval}, "runs": runs}


# --------------------------------------------------------------------------
# (c) cancel latency
# --------------------------------------------------------------------------


async def _cancel_run(env: Targets, target: Target, profile: Profile, *,
                      explicit: bool = False) -> dict[str, Any]:
    """(c) on one target: clients hang up after a few chunks (``explicit``:
    they ``POST /v1/streams/{id}/cancel`` instead and read on); latency from
    the hang-up (the POST's send) to the fake backend seeing its connection
    closed."""
    endpoint = target.endpoint
    since = env.last_record_id()
    closes: dict[str, float] = {}
    rec = Recorder()
    rec.set_window(0.0, float("inf"))  # every stream is a sample

    async def user(session: Any, i: int) -> None:
        # Spread over one stream's lifetime, so the cancels do not all land
        # in the same millisecond (which would measure the burst, not the path).
        await asyncio.sleep(i / profile.cancel_concurrency * profile.cancel_tokens
                            * profile.itl / 2)
        for _ in range(profile.cancel_rounds):
            bench_id = _bench_id(f"cancel-{target.name}")
            body = chat_body(endpoint.model, tokens=profile.cancel_tokens, itl=profile.itl,
                             ttft=profile.ttft, bench_id=bench_id)
            closed = await loadgen.stream_once(session, endpoint, body, rec, time.monotonic(),
                                               cancel_after=profile.cancel_after,
                                               explicit_cancel=explicit)
            if closed is not None:
                closes[bench_id] = closed

    async with new_session() as session, asyncio.TaskGroup() as tg:
        for i in range(profile.cancel_concurrency):
            tg.create_task(user(session, i))
    # The slowest possible propagation we still want to see: one heartbeat.
    await asyncio.sleep(max(1.0, profile.heartbeat_interval))
    seen = {r["bench_id"]: r for r in env.records(since) if r["bench_id"] in closes}
    latencies: list[float] = []
    outcome = {"closed": 0, "completed_anyway": 0, "still_open": 0, "no_record": 0}
    for bench_id, closed_at in closes.items():
        record = seen.get(bench_id)
        if record is None:
            outcome["no_record"] += 1
        elif record["closed_at"] is not None:
            outcome["closed"] += 1
            latencies.append(record["closed_at"] - closed_at)
        elif record["completed"]:
            outcome["completed_anyway"] += 1
        else:
            outcome["still_open"] += 1
    return {"target": target.name, "cancels": len(closes), "outcomes": outcome,
            "stream_errors": dict(rec.errors), "latency_ms": distribution(latencies),
            "latency_cdf_ms": _cdf(latencies)}


async def cancel(env: Targets, targets: list[Target], profile: Profile) -> dict[str, Any]:
    runs = [await _cancel_run(env, t, profile) for t in targets]
    return {"params": {"concurrency": profile.cancel_concurrency,
                       "rounds": profile.cancel_rounds, "cancel_after_chunks":
                       profile.cancel_after, "tokens": profile.cancel_tokens},
            "runs": runs}


# --------------------------------------------------------------------------
# (d) slow clients
# --------------------------------------------------------------------------


async def _sample(env: Targets, target: Target, since: int, ids: set[str],
                  series: list[dict[str, Any]], start: float, stop: asyncio.Event,
                  every: float = 0.5) -> None:
    """RSS of the target's processes and the bytes the backend wrote, over time."""
    while not stop.is_set():
        records = await asyncio.to_thread(env.records, since)
        written = sum(r["bytes_written"] for r in records if r["bench_id"] in ids)
        series.append({"t": round(time.monotonic() - start, 2), "backend_bytes": written,
                       **_rss(target)})
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(every):
                await stop.wait()


async def _slow_run(env: Targets, target: Target, profile: Profile) -> dict[str, Any]:
    endpoint = target.endpoint
    since = env.last_record_id()
    ids = [_bench_id(f"slow-{target.name}") for _ in range(profile.slow_clients)]
    series: list[dict[str, Any]] = []
    stop = asyncio.Event()
    start = time.monotonic()
    path = endpoint.chat_url.split(str(target.port), 1)[1]

    def client(bench_id: str) -> Awaitable[loadgen.SlowResult]:
        # ITL 0: the backend writes as fast as it can, so the buffers on the
        # way fill within the run and only backpressure can hold it back.
        body = chat_body(endpoint.model, tokens=100_000_000, itl=0.0, ttft=0.0,
                         bench_id=bench_id)
        return loadgen.slow_stream("127.0.0.1", target.port, path, body, endpoint.headers,
                                   bytes_per_s=profile.slow_bytes_per_s,
                                   duration=profile.slow_duration)

    async with asyncio.TaskGroup() as tg:
        sampler = tg.create_task(_sample(env, target, since, set(ids), series, start, stop))
        results = await asyncio.gather(*(client(i) for i in ids))
        stop.set()
        await sampler
    await asyncio.sleep(0.5)
    records = {r["bench_id"]: r for r in env.records(since) if r["bench_id"] in set(ids)}
    backend_bytes = sorted(r["bytes_written"] for r in records.values())
    client_bytes = sorted(r.bytes_read for r in results)
    rss: dict[str, dict[str, int | None]] = {}
    for name in target.memory:
        values = [s[name] for s in series if s.get(name) is not None]
        rss[name] = {"start": values[0] if values else None,
                     "max": max(values) if values else None,
                     "end": values[-1] if values else None}
    half = next((s["backend_bytes"] for s in series if s["t"] >= profile.slow_duration / 2), 0)
    return {"target": target.name, "clients": profile.slow_clients,
            "statuses": sorted({r.status_line for r in results}),
            "errors": [r.error for r in results if r.error],
            "client_bytes_p50": int(percentile(client_bytes, 50)) if client_bytes else 0,
            "backend_bytes_p50": int(percentile(backend_bytes, 50)) if backend_bytes else 0,
            "backend_bytes_total_half": half,
            "backend_bytes_total_end": sum(backend_bytes),
            "rss_kib": rss, "rss_series": series}


async def slow_clients(env: Targets, targets: list[Target], profile: Profile) -> dict[str, Any]:
    runs = [await _slow_run(env, t, profile) for t in targets if t.memory]
    return {"params": {"clients": profile.slow_clients, "duration_s": profile.slow_duration,
                       "client_bytes_per_s": profile.slow_bytes_per_s,
                       "backend_itl_s": 0.0}, "runs": runs}


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
            _get, f"http://127.0.0.1:{target.port}/metrics")
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


def profile_dict(profile: Profile) -> dict[str, Any]:
    return asdict(profile)
