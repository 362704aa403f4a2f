"""Scenario (q): what one quota check costs, with 1 and with 3 dispatcher processes.

Each "dispatcher" is a spawned process running the real admission path
(:class:`~dispatcher.admission.QuotaAdmission`, then
:meth:`~dispatcher.quota.QuotaStore.reconcile`) in a closed loop with
``concurrency`` requests in flight, against one ``redis-server`` started here.
Every request is charged against 3 scopes (tenant TPM, tenant x model RPM,
tenant x user concurrency), with limits high enough that nothing is refused.

Measured after a warm-up: wall time per admit and reconcile, client CPU and
Redis CPU per request, round trips and Redis commands per request. The quota
window is shortened to ``window`` seconds so evictions reach steady state
within the run. Docs: docs/benchmarks.md#q-quota-check-cost.
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import multiprocessing
import random
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["FULL", "QUICK", "QuotaProfile", "markdown", "run"]


@dataclass(frozen=True, slots=True)
class QuotaProfile:
    name: str
    # (processes, requests in flight per process, reconcile admitted requests)
    runs: tuple[tuple[int, int, bool], ...]
    warmup: float
    duration: float
    window: float  # the quota store's window, seconds


FULL = QuotaProfile(name="full", runs=((1, 1, True), (1, 16, True), (3, 16, True),
                                     (1, 16, False), (3, 16, False)),
                    warmup=2.0, duration=8.0, window=5.0)
QUICK = QuotaProfile(name="quick", runs=((1, 16, True), (3, 16, True)), warmup=0.5,
                     duration=1.5, window=1.0)

MODEL = "bench-model"
TENANTS = 4
USERS = 4  # per tenant
_UNLIMITED = 1_000_000_000
_PROMPT = ("Summarise the following meeting notes in three bullet points. " * 8).strip()
_BODY: dict[str, Any] = {"model": MODEL, "max_tokens": 256, "stream": True,
                         "messages": [{"role": "system", "content": "You are terse."},
                                      {"role": "user", "content": _PROMPT}]}

_PHASE: contextvars.ContextVar[str] = contextvars.ContextVar("phase", default="other")
# The round trips of the request the current task is making, by phase. Counted
# per request, not sampled at the window's edges: a sample taken late (a busy
# machine wakes the sampler late) splits requests that started in the window
# from their commands, and round trips per request came out 0.97, not 1.
_TRIPS: contextvars.ContextVar[Counter[str]] = contextvars.ContextVar("trips")


# --------------------------------------------------------------------------
# child: one "dispatcher"
# --------------------------------------------------------------------------


def _policies() -> Any:
    from tidegate.control.policies import Policy, PolicySet

    policies = []
    for t in range(TENANTS):
        tenant = f"tenant-{t}"
        policies.append(Policy(tenant=tenant, tpm=_UNLIMITED))
        policies.append(Policy(tenant=tenant, model=MODEL, rpm=_UNLIMITED))
        policies += [Policy(tenant=tenant, user=f"user-{u}", concurrency=_UNLIMITED)
                     for u in range(USERS)]
    return PolicySet(policies)


async def _measure(url: str, prefix: str, index: int, concurrency: int, reconcile: bool,
                   window: float, ready: Any, go: Any, times: Any,
                   finished: Any) -> dict[str, Any]:
    import redis.asyncio as aioredis
    from redis.asyncio.connection import Connection

    from dispatcher.admission import QuotaAdmission
    from dispatcher.quota import QuotaStore, connect
    from tidegate.apis import estimate_prompt_tokens
    from tidegate.config import ModelConfig
    from tidegate.wire.protocol import Admission, Api, Request

    sent: Counter[str] = Counter()  # of the requests measured (started in the window)
    _TRIPS.set(Counter())  # the warm-up's, not counted

    class Counting(Connection):
        """One ``send_packed_command`` is one round trip (a pipeline is one too)."""

        async def send_packed_command(self, command: Any, check_health: bool = True) -> None:
            _TRIPS.get()[_PHASE.get()] += 1
            await super().send_packed_command(command, check_health)

    client = connect(url, timeout=5.0)  # the dispatcher's client settings
    if not isinstance(client, aioredis.Redis):
        raise ValueError("the quota round-trip count needs a single Redis, not a cluster URL")
    client.connection_pool.connection_class = Counting
    store = QuotaStore(client, prefix=prefix, window=window, lease=1800.0)
    admission = QuotaAdmission(store, _policies(), {MODEL: ModelConfig(name=MODEL)},
                               fail_open=False)
    prompt = estimate_prompt_tokens(Api.CHAT, _BODY)

    def request(rid: str, slot: int) -> Request:
        tenant, user = slot % TENANTS, (slot // TENANTS) % USERS
        return Request(id=rid, reply=f"bench.out.{index}.{rid}", model=MODEL, api=Api.CHAT,
                       stream=True, body=_BODY, created_ms=0, deadline_ms=0,
                       window_bytes=65536, window_msgs=128, tenant=f"tenant-{tenant}",
                       user=f"user-{user}")

    # warm-up outside any window: connections open, scripts loaded
    for i in range(concurrency):
        rid = f"warm-{index}-{i}"
        if (await admission.admit(request(rid, i))).admission is Admission.ADMITTED:
            await store.reconcile(rid, prompt)
    ready.set()
    await asyncio.to_thread(go.wait)
    start, w0, w1 = times[0], times[1], times[2]

    admit_s: list[float] = []
    reconcile_s: list[float] = []
    outcome: Counter[str] = Counter()
    marks: dict[str, Any] = {}

    async def sampler() -> None:
        for name, at in (("w0", w0), ("w1", w1)):
            await asyncio.sleep(max(0.0, at - time.monotonic()))
            marks[name] = time.process_time()

    async def user(slot: int) -> None:
        rng = random.Random(index * 1000 + slot)
        trips: Counter[str] = Counter()
        _TRIPS.set(trips)  # this task's (gather runs each user in its own context)
        await asyncio.sleep(max(0.0, start - time.monotonic()) + slot * 0.001)
        n = 0
        while (now := time.monotonic()) < w1:
            rid = f"p{index}-s{slot}-{n}"
            n += 1
            req = request(rid, slot + index * concurrency)
            trips.clear()
            _PHASE.set("reserve")
            t0 = time.perf_counter()
            decision = await admission.admit(req)
            t1 = time.perf_counter()
            admitted = decision.admission is Admission.ADMITTED
            if admitted and reconcile:
                _PHASE.set("reconcile")
                await store.reconcile(rid, prompt + rng.randint(1, 256))
            t2 = time.perf_counter()
            _PHASE.set("other")
            with finished.get_lock():
                finished.value += 1
            if now >= w0:
                outcome["admitted" if admitted else "rejected"] += 1
                sent.update(trips)
                admit_s.append(t1 - t0)
                if admitted and reconcile:
                    reconcile_s.append(t2 - t1)

    try:
        await asyncio.gather(sampler(), *(user(i) for i in range(concurrency)))
    finally:
        await client.aclose()
    return {"admitted": outcome["admitted"], "rejected": outcome["rejected"],
            "admit_s": admit_s, "reconcile_s": reconcile_s,
            "cpu_s": marks["w1"] - marks["w0"], "sent": dict(sent)}


def _child(url: str, prefix: str, index: int, concurrency: int, reconcile: bool,
           window: float, ready: Any, go: Any, times: Any, finished: Any,
           results: Any) -> None:
    from bench import run_async

    try:
        results.put((index, run_async(_measure(url, prefix, index, concurrency, reconcile,
                                               window, ready, go, times, finished))))
    except BaseException as exc:
        results.put((index, {"error": f"{type(exc).__name__}: {exc}"}))
        raise


# --------------------------------------------------------------------------
# parent
# --------------------------------------------------------------------------


def _commandstats(client: Any) -> dict[str, tuple[int, int]]:
    info = client.info("commandstats")
    return {name.removeprefix("cmdstat_"): (int(v["calls"]), int(v["usec"]))
            for name, v in info.items()}


def _one_run(redis_server: Any, processes: int, concurrency: int, reconcile: bool,
             profile: QuotaProfile, run_no: int) -> dict[str, Any]:
    import redis

    from bench import procstats
    from bench.loadgen import distribution

    ctx = multiprocessing.get_context("spawn")
    ready = [ctx.Event() for _ in range(processes)]
    go = ctx.Event()
    times = ctx.Array("d", 3)
    # Requests finished by every process so far: Redis's own counts (and CPU)
    # are divided by the requests finished between the same two samples, so a
    # sample this process takes late (a busy machine) shifts both alike.
    finished = ctx.Value("q", 0)
    results = ctx.Queue()
    prefix = f"bq{run_no}"
    procs = [ctx.Process(target=_child, daemon=True, name=f"quota-bench-{i}",
                         args=(redis_server.url, prefix, i, concurrency, reconcile,
                               profile.window, ready[i], go, times, finished, results))
             for i in range(processes)]
    for p in procs:
        p.start()
    sync = redis.Redis.from_url(redis_server.url, decode_responses=True)
    try:
        for i, event in enumerate(ready):
            if not event.wait(60.0):
                raise RuntimeError(f"quota bench process {i} did not start: exit code "
                                   f"{procs[i].exitcode}")
        start = time.monotonic() + 0.2
        w0 = start + profile.warmup
        w1 = w0 + profile.duration
        times[0], times[1], times[2] = start, w0, w1
        go.set()
        time.sleep(max(0.0, w0 - time.monotonic()))
        stats0, rcpu0 = _commandstats(sync), procstats.cpu_seconds(redis_server.pid)
        done0 = finished.value
        time.sleep(max(0.0, w1 - time.monotonic()))
        done1 = finished.value
        rcpu1, stats1 = procstats.cpu_seconds(redis_server.pid), _commandstats(sync)
        parts: dict[int, dict[str, Any]] = {}
        while len(parts) < processes:
            index, part = results.get(timeout=60.0)
            if "error" in part:
                raise RuntimeError(f"quota bench process {index}: {part['error']}")
            parts[index] = part
        for p in procs:
            p.join(10.0)
        used_memory = int(sync.info("memory")["used_memory"])
        sync.flushall()
    finally:
        sync.close()
        for p in procs:
            if p.is_alive():
                p.kill()
    admitted = sum(p["admitted"] for p in parts.values())
    requests = admitted + sum(p["rejected"] for p in parts.values())
    per = 1 / requests if requests else 0.0
    served = done1 - done0  # the requests Redis's deltas below belong to
    per_served = 1 / served if served > 0 else 0.0
    sent: Counter[str] = Counter()
    for part in parts.values():
        sent.update(part["sent"])
    commands = {name: (calls - stats0.get(name, (0, 0))[0], usec - stats0.get(name, (0, 0))[1])
                for name, (calls, usec) in stats1.items() if name != "info"}
    commands = {k: v for k, v in commands.items() if v[0] > 0}
    redis_cpu = (rcpu1 - rcpu0) if rcpu0 is not None and rcpu1 is not None else None
    client_cpu = sum(p["cpu_s"] for p in parts.values())
    return {
        "processes": processes, "concurrency": concurrency, "reconcile": reconcile,
        "window_s": profile.duration,
        "requests": requests, "admitted": admitted, "rejected": requests - admitted,
        "admissions_per_s": round(requests / profile.duration, 1),
        "admit_us": distribution([x for p in parts.values() for x in p["admit_s"]], 1e6),
        "reconcile_us": distribution([x for p in parts.values() for x in p["reconcile_s"]],
                                     1e6),
        "client_cpu_us_per_request": round(client_cpu * per * 1e6, 1),
        "redis_cpu_us_per_request": (None if redis_cpu is None else
                                     round(redis_cpu * per_served * 1e6, 1)),
        "round_trips_per_request": {k: round(v * per, 3) for k, v in sorted(sent.items())},
        "redis_calls_per_request": {k: round(v[0] * per_served, 3)
                                    for k, v in sorted(commands.items())},
        "redis_usec_per_request": {k: round(v[1] * per_served, 2)
                                   for k, v in sorted(commands.items())},
        "redis_used_memory_bytes": used_memory,
    }


def run(out: Path, quick: bool = False, profile: QuotaProfile | None = None) -> dict[str, Any]:
    """Start a redis-server under ``out``, run every point of the profile
    (``QUICK`` or ``FULL`` unless given) against it, stop it; a JSON-ready dict."""
    import redis

    from fleet.run.servers import RedisServer

    if profile is None:
        profile = QUICK if quick else FULL
    server = RedisServer(out / "quota-redis")
    server.start()
    try:
        with redis.Redis.from_url(server.url, decode_responses=True) as probe:
            version = str(probe.info("server")["redis_version"])
        runs = [_one_run(server, processes, concurrency, reconcile, profile, i)
                for i, (processes, concurrency, reconcile) in enumerate(profile.runs)]
    finally:
        server.stop()
    return {"params": {**dataclasses.asdict(profile), "scopes": 3, "tenants": TENANTS,
                       "users_per_tenant": USERS, "redis_version": version},
            "runs": runs}


def _us(d: dict[str, Any]) -> str:
    return f"{d['p50']:,.0f} / {d['p99']:,.0f}" if d.get("count") else "-"


def markdown(q: dict[str, Any]) -> list[str]:
    """The results.md section of scenario (q)."""
    p = q["params"]
    out = ["## (q) Quota check cost", "",
           f"Each process runs the dispatcher's admission (policy lookup, prompt estimate, "
           f"one reserve script over {p['scopes']} scopes, rate-limit headers) in a closed "
           "loop, and then, in the rows that say so, the reconcile of every admitted "
           f"request. Redis {p['redis_version']}, quota window {p['window']:g} s, "
           f"{p['warmup']:g} s warm-up, {p['duration']:g} s measured. Latency in µs "
           "(p50 / p99). CPU, round trips and Redis commands are per request; Redis "
           "commands include those the scripts run.", "",
           "| processes x in flight | measured | requests/s | admit µs | reconcile µs | "
           "client CPU µs | Redis CPU µs | round trips | Redis commands | rejected |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in q["runs"]:
        trips = r["round_trips_per_request"]
        calls = r["redis_calls_per_request"]
        redis_cpu = r["redis_cpu_us_per_request"]
        trip_text = f"{trips.get('reserve', 0):.2f}"
        if r["reconcile"]:
            trip_text += f" + {trips.get('reconcile', 0):.2f}"
        out.append(
            f"| {r['processes']} x {r['concurrency']} | "
            f"{'admit + reconcile' if r['reconcile'] else 'admit only'} | "
            f"{r['admissions_per_s']:,.0f} | {_us(r['admit_us'])} | {_us(r['reconcile_us'])} | "
            f"{r['client_cpu_us_per_request']:.0f} | "
            f"{'-' if redis_cpu is None else f'{redis_cpu:.0f}'} | {trip_text} | "
            f"{sum(calls.values()):.1f} | {r['rejected']} |")
    return [*out, ""]
