"""Scenario (g) of ``tidegate bench``: the gRPC ingress against SSE.

* load: ``streams`` ``Generate`` calls kept running (closed loop: one ends,
  the next starts) over ``channels`` HTTP/2 connections, then the same
  number of SSE streams in (a)'s closed loop, on the same stack: throughput,
  TTFT and gateway CPU per relayed chunk side by side (a chunk is one SSE
  event on both: a gRPC ``Chunk`` message carrying several counts as several);
* cancel: calls cancelled after a few chunks; latency from ``call.cancel()``
  to the fake backend seeing its connection closed (its records, as in (c)).

The stack is one of its own (``edge.grpc_port`` set), started fresh.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import time
from dataclasses import asdict, dataclass
from typing import Any

import grpc

from bench import loadgen, procstats
from bench.loadgen import Recorder, chat_body, distribution, new_session
from bench.targets import Target, Targets
from fleet.run.servers import free_port
from tidegate.wire import gateway_pb2 as pb
from tidegate.wire import gateway_pb2_grpc as pb_grpc

__all__ = ["FULL", "QUICK", "GrpcProfile", "markdown", "run"]


@dataclass(frozen=True, slots=True)
class GrpcProfile:
    streams: int
    channels: int
    tokens: int
    itl: float
    ttft: float
    warmup: float
    duration: float
    cancels: int
    cancel_after: int  # chunks read before the cancel
    cancel_tokens: int


FULL = GrpcProfile(streams=200, channels=20, tokens=64, itl=0.010, ttft=0.05, warmup=2.0,
                   duration=8.0, cancels=200, cancel_after=8, cancel_tokens=200)
QUICK = GrpcProfile(streams=8, channels=2, tokens=16, itl=0.010, ttft=0.02, warmup=0.5,
                    duration=1.5, cancels=4, cancel_after=4, cancel_tokens=100)

_ids = itertools.count(1)
_Stub: Any = pb_grpc.GatewayStub  # generated, untyped


def _request(target: Target, p: GrpcProfile, tokens: int,
             bench_id: str | None = None) -> pb.GenerateRequest:
    return pb.GenerateRequest(route=pb.ROUTE_CHAT_COMPLETIONS, body=chat_body(
        target.endpoint.model, tokens=tokens, itl=p.itl, ttft=p.ttft, bench_id=bench_id))


def _metadata(target: Target) -> tuple[tuple[str, str], ...]:
    return tuple((k.lower(), v) for k, v in target.endpoint.headers.items())


async def _one(stub: Any, req: pb.GenerateRequest, metadata: Any, rec: Recorder,
               cancel_after: int = 0) -> float | None:
    """One call; returns when it was cancelled (``cancel_after`` > 0)."""
    scheduled = time.monotonic()
    sample = rec.t0 <= scheduled < rec.t1
    rec.sent += 1
    rec.inflight += 1
    first = 0.0
    chunks = 0
    call = stub.Generate(req, metadata=metadata)
    try:
        async for msg in call:
            if msg.HasField("chunk"):
                now = time.monotonic()
                n = msg.chunk.data.count(b"\n\n")
                if not chunks:
                    first = now
                chunks += n
                rec.chunks += n
                if rec.t0 <= now < rec.t1:
                    rec.window_chunks += n
                if cancel_after and chunks >= cancel_after:
                    cancelled = time.monotonic()
                    call.cancel()
                    return cancelled
    except grpc.aio.AioRpcError as err:
        rec.errors[err.code().name.lower()] += 1
        return None
    except asyncio.CancelledError:
        if cancel_after:
            return None
        raise
    finally:
        rec.inflight -= 1
    end = time.monotonic()
    rec.completed += 1
    if rec.t0 <= end < rec.t1:
        rec.window_completed += 1
    if sample and chunks:
        rec.ttft.append(first - scheduled)
        rec.total.append(end - scheduled)
    return None


def _target(target: Target, port: int) -> str:
    host = target.endpoint.base_url.split("//", 1)[1].split(":", 1)[0]
    return f"{host}:{port}"


async def _grpc_load(target: Target, port: int, p: GrpcProfile) -> dict[str, Any]:
    rec = Recorder()
    rec.cpu = procstats.CpuWindow({**target.pids(target.cpu), **target.pids(target.extra)})
    rec.set_window(time.monotonic() + p.warmup, p.duration)
    end = rec.t1
    metadata = _metadata(target)
    channels = [grpc.aio.insecure_channel(_target(target, port)) for _ in range(p.channels)]
    try:
        stubs = [_Stub(c) for c in channels]

        async def slot(i: int) -> None:
            stub = stubs[i % len(stubs)]
            while time.monotonic() < end:
                await _one(stub, _request(target, p, p.tokens), metadata, rec)

        async with asyncio.TaskGroup() as tg:
            tg.create_task(rec.run_window())
            for i in range(p.streams):
                tg.create_task(slot(i))
    finally:
        await asyncio.gather(*(c.close() for c in channels), return_exceptions=True)
    return _summary(target, rec, "grpc", p.streams)


async def _sse_load(target: Target, p: GrpcProfile) -> dict[str, Any]:
    rec = Recorder()
    rec.cpu = procstats.CpuWindow({**target.pids(target.cpu), **target.pids(target.extra)})
    endpoint = target.endpoint

    def body() -> bytes:
        return chat_body(endpoint.model, tokens=p.tokens, itl=p.itl, ttft=p.ttft)

    async with new_session() as session:
        await loadgen.closed_loop(session, endpoint, body, rec, concurrency=p.streams,
                                  warmup=p.warmup, duration=p.duration)
    return _summary(target, rec, "sse", p.streams)


def _summary(target: Target, rec: Recorder, transport: str,
             concurrency: int) -> dict[str, Any]:
    out: dict[str, Any] = {"target": target.name, "transport": transport,
                           "concurrency": concurrency, **rec.summary()}
    used = (rec.cpu.used or {}) if rec.cpu is not None else {}
    gateway = [used.get(name) for name in target.cpu]
    if gateway and all(v is not None for v in gateway):
        total = sum(v for v in gateway if v is not None)
        out["gateway_cpu_s"] = round(total, 3)
        chunks = rec.window_chunks
        out["cpu_us_per_chunk"] = round(total / chunks * 1e6, 1) if chunks else None
    return out


async def _cancel(env: Targets, target: Target, port: int, p: GrpcProfile) -> dict[str, Any]:
    since = env.last_record_id()
    rec = Recorder()
    rec.set_window(0.0, float("inf"))
    metadata = _metadata(target)
    sent: dict[str, float] = {}
    async with grpc.aio.insecure_channel(_target(target, port)) as channel:
        stub = _Stub(channel)

        async def one(i: int) -> None:
            # Spread over half a generation, as (c) and (w) do.
            await asyncio.sleep(i / max(1, p.cancels) * p.cancel_tokens * p.itl / 2)
            bench_id = f"grpccancel-{next(_ids)}"
            at = await _one(stub, _request(target, p, p.cancel_tokens, bench_id), metadata,
                            rec, cancel_after=p.cancel_after)
            if at is not None:
                sent[bench_id] = at

        async with asyncio.TaskGroup() as tg:
            for i in range(p.cancels):
                tg.create_task(one(i))
    await asyncio.sleep(1.0)
    seen = {r["bench_id"]: r for r in await asyncio.to_thread(env.records, since)
            if r["bench_id"] in sent}
    latencies = [seen[b]["closed_at"] - t for b, t in sent.items()
                 if b in seen and seen[b]["closed_at"] is not None]
    return {"target": target.name, "cancels": len(sent), "closed": len(latencies),
            "stream_errors": dict(rec.errors), "latency_ms": distribution(latencies)}


async def run(env: Targets, profile_name: str) -> dict[str, Any]:
    p = QUICK if profile_name == "quick" else FULL
    port = free_port()
    target = await asyncio.to_thread(env.start_tidegate, "grpc",
                                     settings={"edge.grpc_port": port})
    try:
        runs = [await _grpc_load(target, port, p), await _sse_load(target, p)]
        cancel = await _cancel(env, target, port, p)
    finally:
        with contextlib.suppress(Exception):
            await asyncio.to_thread(env.stop_stack, "grpc")
    g, sse = runs
    comparison: dict[str, Any] = {}
    if sse["streams_per_s"]:
        comparison["throughput_ratio_grpc_over_sse"] = round(
            g["streams_per_s"] / sse["streams_per_s"], 3)
    if g["ttft_ms"].get("count") and sse["ttft_ms"].get("count"):
        comparison["ttft_grpc_minus_sse_ms"] = {
            q: round(g["ttft_ms"][q] - sse["ttft_ms"][q], 3) for q in ("p50", "p99")}
    return {"params": asdict(p), "runs": runs, "comparison": comparison, "cancel": cancel}


def markdown(g: dict[str, Any]) -> list[str]:
    p = g["params"]
    out = ["## (g) gRPC against SSE", "",
           f"{p['streams']} `Generate` calls over {p['channels']} HTTP/2 connections (closed "
           f"loop), then {p['streams']} SSE streams on the same stack; {p['tokens']} tokens "
           f"at {p['itl'] * 1000:g} ms ITL.", "",
           "| transport | streams/s | chunks/s | TTFT p50 / p99 ms | errors | CPU µs/chunk |",
           "| --- | --- | --- | --- | --- | --- |"]
    for r in g["runs"]:
        t = r["ttft_ms"]
        out.append(f"| {r['transport']} | {r['streams_per_s']} | {r['chunks_per_s']} | "
                   f"{t.get('p50', '-')} / {t.get('p99', '-')} | {r['error_count']} | "
                   f"{r.get('cpu_us_per_chunk', '-')} |")
    cancel = g["cancel"]
    lat = cancel["latency_ms"]
    out += ["", f"Comparison: {json.dumps(g['comparison'])}.", "",
            f"Cancels: {cancel['cancels']} calls cancelled, {cancel['closed']} backend closes "
            f"seen; latency p50 / p99 {lat.get('p50', '-')} / {lat.get('p99', '-')} ms.", ""]
    return out
