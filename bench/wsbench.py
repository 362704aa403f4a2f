"""Scenario (w) of ``tidegate bench``: the WebSocket ingress against SSE.

* load: ``sockets`` WebSockets with ``per_socket`` generations each (closed
  loop), then as many SSE streams on the same stack: TTFT and throughput;
* idle: ``idle_sockets`` authenticated sockets on a fresh stack: RSS per socket;
* cancel: ``cancel`` frames after a few chunks, timed to the backend's close.

Parameters come from :data:`FULL` / :data:`QUICK`, by the run's profile name.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import time
from dataclasses import asdict, dataclass
from typing import Any

from websockets.asyncio.client import ClientConnection
from websockets.asyncio.client import connect as ws_connect

from bench import loadgen, procstats
from bench.loadgen import Recorder, chat_body, distribution, new_session
from bench.targets import Target, Targets

__all__ = ["FULL", "QUICK", "WsProfile", "run"]


@dataclass(frozen=True, slots=True)
class WsProfile:
    sockets: int
    per_socket: int
    tokens: int
    itl: float
    ttft: float
    warmup: float
    duration: float
    idle_sockets: int
    cancel_sockets: int
    cancel_after: int  # chunks read before the cancel frame
    cancel_tokens: int


FULL = WsProfile(sockets=200, per_socket=4, tokens=64, itl=0.010, ttft=0.05, warmup=2.0,
                 duration=8.0, idle_sockets=2000, cancel_sockets=50, cancel_after=8,
                 cancel_tokens=200)
QUICK = WsProfile(sockets=4, per_socket=4, tokens=16, itl=0.010, ttft=0.02, warmup=0.5,
                  duration=1.5, idle_sockets=20, cancel_sockets=4, cancel_after=4,
                  cancel_tokens=100)

_ids = itertools.count(1)


def ws_url(target: Target) -> str:
    base = target.endpoint.base_url
    return ("ws" + base[4:] if base.startswith("http") else base) + "/ws"


class _Gen:
    __slots__ = ("bench_id", "chunks", "done", "error", "first", "scheduled")

    def __init__(self, scheduled: float, bench_id: str = "") -> None:
        self.scheduled = scheduled
        self.bench_id = bench_id
        self.first = 0.0
        self.chunks = 0
        self.error: str | None = None
        self.done = asyncio.Event()


class _Socket:
    """One client socket: a reader task routes frames to generations by id."""

    def __init__(self, ws: ClientConnection, rec: Recorder) -> None:
        self.ws = ws
        self.rec = rec
        self.gens: dict[str, _Gen] = {}
        self.cancel_after: int | None = None
        self.cancelled_at: dict[str, float] = {}  # bench_id -> when the cancel was sent

    async def read(self) -> None:
        rec = self.rec
        with contextlib.suppress(Exception):
            async for raw in self.ws:
                now = time.monotonic()
                frame = json.loads(raw)
                gen = self.gens.get(frame.get("id", ""))
                if gen is None:
                    continue
                kind = frame["type"]
                if kind == "chunk":
                    if not gen.chunks:
                        gen.first = now
                    gen.chunks += 1
                    rec.chunks += 1
                    if rec.t0 <= now < rec.t1:
                        rec.window_chunks += 1
                    if self.cancel_after is not None and gen.chunks == self.cancel_after:
                        self.cancelled_at[gen.bench_id] = time.monotonic()
                        await self.ws.send(json.dumps({"type": "cancel", "id": frame["id"]}))
                elif kind in ("done", "cancelled"):
                    gen.done.set()
                elif kind == "error":
                    gen.error = str(frame["error"].get("code") or "error")
                    gen.done.set()
        for gen in self.gens.values():  # the socket ended: nothing more will come
            if not gen.done.is_set():
                gen.error = gen.error or "socket_closed"
                gen.done.set()

    async def generate(self, gid: str, body: dict[str, Any], bench_id: str = "") -> None:
        rec = self.rec
        scheduled = time.monotonic()
        sample = rec.t0 <= scheduled < rec.t1
        gen = self.gens[gid] = _Gen(scheduled, bench_id)
        rec.sent += 1
        rec.inflight += 1
        try:
            await self.ws.send(json.dumps({"type": "request", "id": gid,
                                           "path": "/v1/chat/completions", "body": body}))
            await gen.done.wait()
        finally:
            rec.inflight -= 1
            del self.gens[gid]
        end = time.monotonic()
        if gen.error is not None:
            rec.errors[gen.error] += 1
            return
        rec.completed += 1
        if rec.t0 <= end < rec.t1:
            rec.window_completed += 1
        if sample and gen.chunks:
            rec.ttft.append(gen.first - scheduled)
            rec.total.append(end - scheduled)


def _body(target: Target, p: WsProfile, tokens: int, bench_id: str | None = None) -> Any:
    return json.loads(chat_body(target.endpoint.model, tokens=tokens, itl=p.itl, ttft=p.ttft,
                                bench_id=bench_id))


async def _ws_load(target: Target, p: WsProfile) -> dict[str, Any]:
    rec = Recorder()
    rec.cpu = procstats.CpuWindow({**target.pids(target.cpu), **target.pids(target.extra)})
    start = time.monotonic()
    rec.set_window(start + p.warmup, p.duration)
    end = rec.t1
    headers = dict(target.endpoint.headers)

    async def socket_loop(i: int) -> None:
        async with ws_connect(ws_url(target), additional_headers=headers, max_size=None,
                              compression=None) as ws:
            sock = _Socket(ws, rec)
            reader = asyncio.create_task(sock.read())

            async def slot(j: int) -> None:
                n = 0
                while time.monotonic() < end:
                    n += 1
                    await sock.generate(f"{j}-{n}", _body(target, p, p.tokens))

            try:
                async with asyncio.TaskGroup() as tg:
                    for j in range(p.per_socket):
                        tg.create_task(slot(j))
            finally:
                reader.cancel()
                await asyncio.gather(reader, return_exceptions=True)

    async with asyncio.TaskGroup() as tg:
        tg.create_task(rec.run_window())
        for i in range(p.sockets):
            tg.create_task(socket_loop(i))
    return _summary(target, rec, "websocket", p.sockets * p.per_socket)


async def _sse_load(target: Target, p: WsProfile) -> dict[str, Any]:
    rec = Recorder()
    rec.cpu = procstats.CpuWindow({**target.pids(target.cpu), **target.pids(target.extra)})
    endpoint = target.endpoint

    def body() -> bytes:
        return chat_body(endpoint.model, tokens=p.tokens, itl=p.itl, ttft=p.ttft)

    async with new_session() as session:
        await loadgen.closed_loop(session, endpoint, body, rec,
                                  concurrency=p.sockets * p.per_socket, warmup=p.warmup,
                                  duration=p.duration)
    return _summary(target, rec, "sse", p.sockets * p.per_socket)


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


async def _idle(target: Target, p: WsProfile) -> dict[str, Any]:
    """``idle_sockets`` authenticated sockets held open; RSS per socket.

    ``target`` must be a fresh stack (see :func:`run`): an edge that has
    just relayed a load keeps the memory it freed for reuse, and new sockets
    fill that first, which once made 2,000 sockets look like 0.02 KiB each.
    """
    def rss() -> dict[str, int | None]:
        return {n: procstats.rss_kib(pid) for n, pid in target.pids(target.memory).items()}

    headers = dict(target.endpoint.headers)
    before = rss()
    conns: list[ClientConnection] = []
    failures: dict[str, int] = {}
    try:
        for first in range(0, p.idle_sockets, 100):  # paced: listen backlogs are finite
            opened = await asyncio.gather(
                *(ws_connect(ws_url(target), additional_headers=headers, compression=None,
                             open_timeout=30.0, ping_interval=None)
                  for _ in range(min(100, p.idle_sockets - first))),
                return_exceptions=True)
            for c in opened:
                if isinstance(c, BaseException):
                    key = type(c).__name__
                    failures[key] = failures.get(key, 0) + 1
                else:
                    conns.append(c)
        await asyncio.sleep(1.0)  # let allocations settle
        held = rss()
        # Still open after the hold: the edge closed none of them.
        still_open = sum(1 for c in conns if c.close_code is None)
    finally:
        await asyncio.gather(*(c.close() for c in conns), return_exceptions=True)
    n = len(conns)
    per_socket = {name: (round((held[name] - b) / n, 2)  # type: ignore[operator]
                         if n and b is not None and held[name] is not None else None)
                  for name, b in before.items()}
    return {"target": target.name, "sockets": p.idle_sockets, "open_ok": n,
            "still_open": still_open, "failures": failures,
            "rss_kib": {name: {"before": before[name], "held": held[name]} for name in before},
            "rss_per_socket_kib": per_socket}


async def _cancel(env: Targets, target: Target, p: WsProfile) -> dict[str, Any]:
    since = env.last_record_id()
    rec = Recorder()
    rec.set_window(0.0, float("inf"))
    headers = dict(target.endpoint.headers)
    sent: dict[str, float] = {}

    async def one(i: int) -> None:
        await asyncio.sleep(i / max(1, p.cancel_sockets) * p.cancel_tokens * p.itl / 2)
        async with ws_connect(ws_url(target), additional_headers=headers,
                              compression=None) as ws:
            sock = _Socket(ws, rec)
            sock.cancel_after = p.cancel_after
            reader = asyncio.create_task(sock.read())
            try:
                async with asyncio.TaskGroup() as tg:  # per_socket at once, as in the load
                    for j in range(p.per_socket):
                        bench_id = f"wscancel-{next(_ids)}"
                        tg.create_task(sock.generate(
                            f"c{j}", _body(target, p, p.cancel_tokens, bench_id), bench_id))
            finally:
                reader.cancel()
                await asyncio.gather(reader, return_exceptions=True)
            sent.update(sock.cancelled_at)

    async with asyncio.TaskGroup() as tg:
        for i in range(p.cancel_sockets):
            tg.create_task(one(i))
    await asyncio.sleep(1.0)
    seen = {r["bench_id"]: r for r in await asyncio.to_thread(env.records, since)
            if r["bench_id"] in sent}
    latencies = [seen[b]["closed_at"] - t for b, t in sent.items()
                 if b in seen and seen[b]["closed_at"] is not None]
    return {"target": target.name, "cancels": len(sent), "closed": len(latencies),
            "stream_errors": dict(rec.errors), "latency_ms": distribution(latencies)}


async def run(env: Targets, target: Target, profile_name: str) -> dict[str, Any]:
    p = QUICK if profile_name == "quick" else FULL
    ws = await _ws_load(target, p)
    sse = await _sse_load(target, p)
    comparison: dict[str, Any] = {}
    if ws["ttft_ms"].get("count") and sse["ttft_ms"].get("count"):
        comparison["ttft_ws_minus_sse_ms"] = {
            q: round(ws["ttft_ms"][q] - sse["ttft_ms"][q], 3) for q in ("p50", "p99")}
    if sse["streams_per_s"]:
        comparison["throughput_ratio_ws_over_sse"] = round(
            ws["streams_per_s"] / sse["streams_per_s"], 3)
    cancel = await _cancel(env, target, p)
    # The idle sockets on a stack of their own, fresh (see _idle).
    fresh = await asyncio.to_thread(env.start_tidegate, "ws-idle")
    try:
        idle = await _idle(fresh, p)
    finally:
        await asyncio.to_thread(env.stop_stack, "ws-idle")
    return {"params": asdict(p), "runs": [ws, sse], "comparison": comparison,
            "idle": idle, "cancel": cancel}


def markdown(w: dict[str, Any]) -> list[str]:
    p = w["params"]
    out = ["## (w) WebSocket against SSE", "",
           f"{p['sockets']} sockets x {p['per_socket']} concurrent generations (closed loop), "
           f"then {p['sockets'] * p['per_socket']} SSE streams on the same stack; "
           f"{p['tokens']} tokens at {p['itl'] * 1000:g} ms ITL.", "",
           "| transport | streams/s | chunks/s | TTFT p50 / p99 ms | errors | CPU µs/chunk |",
           "| --- | --- | --- | --- | --- | --- |"]
    for r in w["runs"]:
        t = r["ttft_ms"]
        out.append(f"| {r['transport']} | {r['streams_per_s']} | {r['chunks_per_s']} | "
                   f"{t.get('p50', '-')} / {t.get('p99', '-')} | {r['error_count']} | "
                   f"{r.get('cpu_us_per_chunk', '-')} |")
    idle, cancel = w["idle"], w["cancel"]
    lat = cancel["latency_ms"]
    out += ["", f"Comparison: {w['comparison']}.", "",
            f"Idle (a fresh stack): {idle['open_ok']} of {idle['sockets']} sockets held "
            f"({idle.get('still_open', '-')} still open after the hold; failures: "
            f"{idle.get('failures') or 'none'}); RSS per socket "
            f"(KiB): {idle['rss_per_socket_kib']}.", "",
            f"Cancel frames: {cancel['cancels']} sent, {cancel['closed']} backend closes "
            f"seen; latency p50 / p99 {lat.get('p50', '-')} / {lat.get('p99', '-')} ms.", ""]
    return out
