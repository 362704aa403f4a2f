"""Scenario (a) of ``tidegate bench``, overhead and throughput: a closed loop at
each concurrency and one open-loop rate on every target, with TTFT overhead and
throughput against the direct target at the same load. (e) is (a) on the peers."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import Any

from bench import loadgen, procstats
from bench.loadgen import (
    Recorder,
    chat_body,
    messages_body,
    new_session,
    responses_body,
)
from bench.profiling import PySpy
from bench.scenarios import Profile, _cdf, _cpu_pids
from bench.targets import TRANSLATED, Target


async def _load_run(target: Target, profile: Profile, mode: str, load: float,
                    spy: PySpy | None, api: str = "chat",
                    arrival: str = "spread") -> dict[str, Any]:
    """One load level on one target; ``api`` "responses" streams the Responses
    API instead of chat, "messages" / "messages-translated" Anthropic's
    Messages API (``bench.responses_bench``); ``arrival``
    "burst" starts a closed loop's users all at once instead of spread."""
    endpoint = target.endpoint
    make: Callable[..., bytes] = chat_body
    if api == "responses":
        endpoint, make = dataclasses.replace(endpoint, path="/responses"), responses_body
    elif api.startswith("messages"):
        # "messages": passed through to the fake's /v1/messages; "messages-
        # translated": tidegate's TRANSLATED model, the same fake, via chat.
        model = TRANSLATED if api == "messages-translated" and target.name != "direct" \
            else endpoint.model
        endpoint = dataclasses.replace(endpoint, path="/messages", model=model)
        make = messages_body
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

    direct = {key(r): r for r in runs if r["target"] == "direct"}
    for r in runs:
        base = direct.get(key(r))
        if base is None or r is base:
            continue
        ours, theirs = r["ttft_ms"], base["ttft_ms"]
        if ours.get("count") and theirs.get("count"):
            r["ttft_overhead_ms"] = {p: round(ours[p] - theirs[p], 3) for p in ("p50", "p99")}
        if base["streams_per_s"]:
            r["throughput_ratio"] = round(r["streams_per_s"] / base["streams_per_s"], 3)
        if base["chunks_per_s"]:
            r["chunks_ratio"] = round(r["chunks_per_s"] / base["chunks_per_s"], 3)
    floor = {key(r): r for r in runs if r["target"] == "floor"}
    for r in runs:
        if r["target"] == "tidegate" and key(r) in floor:
            r["over_floor"] = _over(r, floor[key(r)])


def _over(ours: dict[str, Any], floor: dict[str, Any]) -> dict[str, Any]:
    """tidegate against the floor (:mod:`bench.floor`) at the same load: its
    CPU per chunk and TTFT p99 as ratios, its throughput share of direct as
    a difference (docs/benchmarks.md's targets: <= 1.15x, <= 1.3x, >= -0.03)."""
    def ratio(a: Any, b: Any) -> float | None:
        return round(a / b, 3) if a and b else None

    share = (None if ours.get("throughput_ratio") is None or floor.get("throughput_ratio") is None
             else round(ours["throughput_ratio"] - floor["throughput_ratio"], 3))
    return {"cpu_us_per_chunk": ratio(ours.get("cpu_us_per_chunk"),
                                      floor.get("cpu_us_per_chunk")),
            "ttft_p99": ratio(ours["ttft_ms"].get("p99"), floor["ttft_ms"].get("p99")),
            "throughput_share": share}


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
