"""Scenarios (b) and (d) of ``tidegate bench``, a gateway's memory: (b) idle
stream capacity (N streams held open, heartbeats only: RSS per stream and idle
CPU) and (d) slow clients (clients reading a few KiB/s: RSS over time)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable
from typing import Any

from bench import loadgen, procstats
from bench.loadgen import chat_body, new_session, percentile
from bench.scenarios import Profile, _bench_id, _cpu_pids
from bench.targets import Target, Targets
from tidegate.config.sections import DEFAULT_MAX_OUTPUT_TOKENS

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
        # way fill within the run and only backpressure can hold it back. The
        # most tokens a model allows by default (max_output_tokens): about
        # 40 MB of events, far more than any buffer on the way holds.
        body = chat_body(endpoint.model, tokens=DEFAULT_MAX_OUTPUT_TOKENS, itl=0.0, ttft=0.0,
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
