"""``tidegate status``: what the fleet is doing now, from NATS and Redis.

Read-only. Sources:

* JetStream: per model, the worker consumer's ``num_pending`` (waiting) and
  ``num_ack_pending`` (running), the oldest waiting job's age, and deliveries
  (:mod:`tidegate.control.queue_stats`); the requests consumer's backlog; stream
  counters for rates;
* the ``<P>_WORKERS`` KV registry: live workers, their slots and jobs in
  flight (:mod:`tidegate.control.workers_registry`); for a model with
  ``max_streams = "auto"`` the slots are the workers' adaptive limits, and
  the model's total is the limit in front of its backend;
* Redis: queue mode per model (``mode``, ``limit``, ``p99_ms``) and the
  number of requests held in its fair queue, as the dispatchers keep them
  (:mod:`dispatcher.queueing`). Without Redis those columns say ``?``;
* the state file of a ``tidegate up`` in the config file's directory (its data
  dir): every child process, pid and restart count (:mod:`tidegate.run.supervisor`).

Rates (requests, jobs started and finished per second) are the difference of
two samples: the live view's refresh interval, or one interval for
``--json``, which prints one document and exits.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from nats.js import JetStreamContext

from tidegate.broker import broker
from tidegate.config import Config
from tidegate.control import edges_registry, workers_registry
from tidegate.control.admin import connect_once
from tidegate.control.queue_stats import QueueStats, Snapshot
from tidegate.run.supervisor import read_state


@dataclass(frozen=True, slots=True)
class QueueModeView:
    mode: str  # "normal" | "queue" | "?" (Redis unreachable)
    limit: int = 0
    p99_ms: float = 0.0
    queued: int = 0  # held in the fair queue


async def _queue_modes(config: Config) -> dict[str, QueueModeView]:
    from dispatcher.queueing import QueueMode
    from dispatcher.quota import QuotaUnavailable
    from dispatcher.quota import connect as connect_redis

    client = connect_redis(config.redis.url, config.redis.timeout)
    queue = QueueMode(client, config.nats.subject_prefix)
    out: dict[str, QueueModeView] = {}
    try:
        for model in config.models:
            try:
                state = await queue.state(model.name)
                queued = await queue.queued(model.name)
            except QuotaUnavailable:
                out[model.name] = QueueModeView("?")
                continue
            out[model.name] = QueueModeView("queue" if state.queueing else "normal",
                                            state.limit, state.p99_ms, queued)
    finally:
        await client.aclose()
    return out


async def _batches(js: JetStreamContext, config: Config) -> list[dict[str, Any]]:
    """Active batches (the batch API's KV bucket); empty where it cannot be read."""
    from tidegate.control import batch_admin

    try:
        return await batch_admin.active_rows(js, config)
    except Exception:
        return []


def _rate(now: int, before: int, seconds: float) -> float:
    return round(max(0, now - before) / seconds, 2) if seconds > 0 else 0.0


def document(config: Config, snap: Snapshot, previous: Snapshot | None,
             modes: dict[str, QueueModeView],
             processes: dict[str, Any] | None = None,
             batches: list[dict[str, Any]] | None = None,
             edges: dict[str, Any] | None = None) -> dict[str, Any]:
    """The status as plain data: what ``--json`` prints and the view shows.

    ``processes`` is a ``tidegate up`` state file (None: not run by one);
    ``batches`` the active batches (``tidegate.control.batch_admin.active_rows``).
    """
    dt = snap.taken - previous.taken if previous is not None else 0.0
    prev_models = {q.model: q for q in previous.models} if previous is not None else {}
    models: list[dict[str, Any]] = []
    for q in snap.models:
        serving = [w for w in snap.workers if q.model in w.models]
        slots = sum(w.models[q.model].slots for w in serving)
        used = sum(w.models[q.model].in_flight for w in serving)
        before = prev_models.get(q.model)
        mode = modes.get(q.model)
        models.append({
            "model": q.model,
            "replicas": _replicas(q.model, snap.workers),
            "workers": len(serving),
            "slots": {"total": slots, "used": used, "free": max(0, slots - used)},
            # Slots are adaptive limits (workers.limiter), not a pinned max_streams.
            "adaptive": any(w.models[q.model].adaptive for w in serving),
            "queue": {"depth": q.depth, "waiting": q.waiting, "running": q.running,
                      "oldest_age_s": round(q.oldest_age, 3)},
            "queue_mode": None if mode is None else {
                "mode": mode.mode, "limit": mode.limit, "p99_ms": mode.p99_ms,
                "queued": mode.queued},
            "rates": None if before is None else {
                "started_per_s": _rate(q.delivered, before.delivered, dt),
                "finished_per_s": _rate(snap.finished.get(q.model, 0),
                                        previous.finished.get(q.model, 0) if previous else 0,
                                        dt)},
        })
    now = snap.taken
    workers = [{
        "worker_id": w.worker_id, "host": w.host, "pid": w.pid,
        "uptime_s": round(max(0.0, now - w.started), 1),
        "heartbeat_age_s": round(max(0.0, now - w.updated), 1),
        "draining": w.draining,
        "models": {m: {"slots": s.slots, "in_flight": s.in_flight,
                       **({"adaptive": True} if s.adaptive else {})}
                   for m, s in w.models.items()},
    } for w in snap.workers]
    return {
        "taken": round(snap.taken, 3),
        "nats": config.nats.url,
        "dispatch_backlog": snap.backlog,
        "requests_per_s": None if previous is None else _rate(
            snap.requests_total, previous.requests_total, dt),
        "models": models,
        "workers": workers,
        "processes": None if processes is None else processes.get("processes", []),
        "batches": batches or [],
        # tidegate.control.edges_registry.summary: open requests and WebSockets.
        "edges": edges,
    }


def _replicas(model: str, workers: Any) -> list[dict[str, Any]]:
    """A model's backend replicas (models with several, docs/routing.md):
    in-flight streams, slots (the adaptive limit where one applies), and the
    share of its conversation jobs that reached it as their home."""
    out: dict[str, dict[str, Any]] = {}
    for w in workers:
        for replica, s in w.replicas.get(model, {}).items():
            r = out.setdefault(replica, {"replica": replica, "workers": 0, "in_flight": 0,
                                         "slots": 0, "jobs": 0, "hits": 0})
            r["workers"] += 1
            r["in_flight"] += s.in_flight
            r["slots"] += s.slots
            r["jobs"] += s.jobs
            r["hits"] += s.hits
    for r in out.values():
        r["hit_rate"] = round(r["hits"] / r["jobs"], 3) if r["jobs"] else None
    return [out[k] for k in sorted(out)]


def render(doc: dict[str, Any]) -> Any:
    """A rich renderable of :func:`document`'s output."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    rps = doc["requests_per_s"]
    header = Text.assemble(
        ("tidegate status", "bold"), f"  nats {doc['nats']}",
        f"  dispatch backlog {doc['dispatch_backlog']}",
        f"  requests/s {'-' if rps is None else f'{rps:g}'}",
        f"  {time.strftime('%H:%M:%S', time.localtime(doc['taken']))}")

    models = Table(title="Models", title_justify="left", expand=True)
    for column in ("model", "workers", "slots used/total", "waiting", "running", "oldest",
                   "mode", "limit", "p99 TTFT", "held", "started/s", "finished/s"):
        models.add_column(column, justify="left" if column in ("model", "mode") else "right")
    for m in doc["models"]:
        qm = m["queue_mode"]
        mode = "-" if qm is None else qm["mode"]
        style = "bold red" if mode == "queue" else ("yellow" if mode == "?" else "")
        q, slots, rates = m["queue"], m["slots"], m["rates"]
        models.add_row(
            m["model"],
            Text(str(m["workers"]), style="bold red" if not m["workers"] and q["depth"] else ""),
            f"{slots['used']}/{slots['total']}{' auto' if m.get('adaptive') else ''}",
            str(q["waiting"]), str(q["running"]),
            _age(q["oldest_age_s"]), Text(mode, style=style),
            "-" if qm is None or mode != "queue" else str(qm["limit"]),
            "-" if qm is None or not qm["p99_ms"] else f"{qm['p99_ms']:.0f} ms",
            "-" if qm is None else str(qm["queued"]),
            "-" if rates is None else f"{rates['started_per_s']:g}",
            "-" if rates is None else f"{rates['finished_per_s']:g}")

    replicas = Table(title="Replicas", title_justify="left", expand=True)
    for column in ("model", "replica", "workers", "in flight/slots", "affinity hit rate"):
        replicas.add_column(column)
    for m in doc["models"]:
        for r in m.get("replicas") or ():
            replicas.add_row(m["model"], r["replica"], str(r["workers"]),
                             f"{r['in_flight']}/{r['slots']}",
                             "-" if r["hit_rate"] is None
                             else f"{r['hit_rate']:.0%} of {r['jobs']}")

    workers = Table(title="Workers", title_justify="left", expand=True)
    for column in ("worker", "host", "pid", "up", "models (in flight/slots)", "heartbeat"):
        workers.add_column(column)
    for w in doc["workers"]:
        served = ", ".join(
            f"{m} {s['in_flight']}/{s['slots']}{' auto' if s.get('adaptive') else ''}"
            for m, s in w["models"].items())
        workers.add_row(w["worker_id"] + (" (draining)" if w["draining"] else ""), w["host"],
                        str(w["pid"]), _age(w["uptime_s"]), served,
                        f"{w['heartbeat_age_s']:.0f}s ago")
    if not doc["workers"]:
        workers.add_row(Text("no live workers", style="bold red"), "", "", "", "", "")
    tables: list[Any] = [header, models, *([replicas] if replicas.row_count else []), workers]
    if doc.get("edges") is not None:
        tables.append(_edges_table(doc["edges"]))
    if doc.get("batches"):
        from tidegate.control import batch_admin

        tables.append(batch_admin.render(doc["batches"]))
    if not doc.get("processes"):
        return Group(*tables)
    procs = Table(title="Processes (tidegate up)", title_justify="left", expand=True)
    for column in ("process", "pid", "state", "restarts", "last exit code"):
        procs.add_column(column)
    for p in doc["processes"]:
        state = "running" if p["running"] else (
            "restarting" if p["restart_pending"] else "down")
        procs.add_row(p["name"], str(p["pid"]),
                      Text(state, style="" if p["running"] else "bold red"),
                      Text(str(p["restarts"]), style="yellow" if p["restarts"] else ""),
                      "-" if p["last_exit_code"] is None else str(p["last_exit_code"]))
    return Group(*tables, procs)


def _edges_table(edges: dict[str, Any]) -> Any:
    from rich.table import Table

    total = edges["total"]
    table = Table(title=f"Edges: {total['edges']} live, {total['streams']} open requests, "
                        f"{total['ws_connections']} WebSockets running "
                        f"{total['ws_generations']} generations",
                  title_justify="left", expand=True)
    for column in ("edge", "host", "open requests", "WebSockets", "ws generations", "up"):
        table.add_column(column)
    for e in edges["edges"]:
        table.add_row(e["edge_id"] + (" (draining)" if e["draining"] else ""), e["host"],
                      str(e["streams"]), str(e["ws_connections"]), str(e["ws_generations"]),
                      _age(e["uptime_s"]))
    return table


def _age(seconds: float) -> str:
    if seconds <= 0:
        return "-"
    if seconds < 60:
        return f"{seconds:.1f}s"
    if seconds < 3600:
        return f"{seconds // 60:.0f}m{seconds % 60:02.0f}s"
    return f"{seconds // 3600:.0f}h{seconds % 3600 // 60:02.0f}m"


async def _run(config: Config, as_json: bool, once: bool, interval: float,
               out: IO[str], data_dir: Path | None) -> int:
    def processes() -> dict[str, Any] | None:
        return None if data_dir is None else read_state(data_dir)

    nc = await connect_once(config.nats, "tidegate-status")
    try:
        js = broker.jetstream(nc, config.nats)
        registry = await workers_registry.ensure_bucket(js, config)
        edges_kv = await edges_registry.ensure_bucket(js, config)

        async def edges() -> dict[str, Any]:
            return edges_registry.summary(await edges_registry.read_all(edges_kv), time.time())

        stats = QueueStats(js, config, registry)
        previous = await stats.snapshot()
        if as_json or once:
            await asyncio.sleep(interval)
            doc = document(config, await stats.snapshot(), previous,
                           await _queue_modes(config), processes(),
                           await _batches(js, config), await edges())
            if as_json:
                out.write(json.dumps(doc, indent=2) + "\n")
            else:
                from rich.console import Console

                Console(file=out, width=None if out.isatty() else 160).print(render(doc))
            return 0
        from rich.console import Console
        from rich.live import Live

        doc = document(config, previous, None, await _queue_modes(config), processes(),
                       await _batches(js, config), await edges())
        with Live(render(doc), console=Console(file=out), refresh_per_second=4,
                  screen=False) as live:
            while True:
                await asyncio.sleep(interval)
                snap = await stats.snapshot()
                doc = document(config, snap, previous, await _queue_modes(config),
                               processes(), await _batches(js, config), await edges())
                previous = snap
                live.update(render(doc))
    finally:
        await nc.close()


def run(config: Config, as_json: bool = False, once: bool = False,
        interval: float | None = None, out: IO[str] | None = None,
        data_dir: Path | None = None) -> int:
    """``tidegate status``; the exit code. Ctrl-C ends the live view (0).

    ``data_dir``: where a ``tidegate up`` keeps its process state file.
    """
    wait = interval if interval is not None else (1.0 if as_json or once else 2.0)
    try:
        return asyncio.run(_run(config, as_json, once, wait, out or sys.stdout, data_dir))
    except KeyboardInterrupt:
        return 0
