"""``tidegate status``: what the fleet is doing now, from NATS and Redis (read-only).

Sources: JetStream per model (waiting, running, oldest job, deliveries:
:mod:`tidegate.control.queue_stats`); the ``<P>_WORKERS`` registry (live
workers, slots, jobs; the adaptive limits of ``max_streams = "auto"``); Redis
(queue mode and its fair queue, ``?`` without Redis); the state file of a
``tidegate up`` (children, pids, restarts). Rates are the difference of two
samples.

The view (:mod:`fleet.run.status_view`) fits the terminal's width. A NATS
that goes away while the view watches is a line saying so, and the view
reconnects; only a NATS missing at the start or in ``--json``/``--once`` ends
the command (exit 1). Docs: docs/observability.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import signal
import sys
import time
from collections.abc import Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import nats.errors
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from fleet.run import status_view
from fleet.run.supervisor import read_state
from tidegate.broker import broker
from tidegate.config import Config
from tidegate.control import edges_registry, workers_registry
from tidegate.control.admin import connect_once
from tidegate.control.queue_stats import QueueStats, Snapshot
from tidegate.errors import BrokerError


@dataclass(frozen=True, slots=True)
class QueueModeView:
    mode: str  # "normal" | "queue" | "?" (Redis unreachable)
    limit: int = 0
    p99_ms: float = 0.0
    queued: int = 0  # held in the fair queue
    by_class: tuple[tuple[str, int], ...] = ()  # of those, per class (tidegate.wire.classes)


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
                by_class = tuple((await queue.queued_by_class(model.name)).items())
            except QuotaUnavailable:
                out[model.name] = QueueModeView("?")
                continue
            out[model.name] = QueueModeView("queue" if state.queueing else "normal",
                                            state.limit, state.p99_ms, queued, by_class)
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
                "queued": mode.queued, "queued_by_class": dict(mode.by_class)},
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


class Source:
    """One NATS connection's readers: the JetStream queues, the worker and
    edge registries, batches; plus Redis and the ``tidegate up`` state file."""

    def __init__(self, nc: NATS, config: Config, data_dir: Path | None) -> None:
        self.nc = nc
        self.config = config
        self.data_dir = data_dir
        self.js = broker.jetstream(nc, config.nats)
        self.stats: QueueStats | None = None
        self.edges_kv: KeyValue | None = None

    async def open(self) -> Snapshot:
        """Bind the buckets; the first sample (rates need a second one)."""
        registry = await workers_registry.ensure_bucket(self.js, self.config)
        self.edges_kv = await edges_registry.ensure_bucket(self.js, self.config)
        self.stats = QueueStats(self.js, self.config, registry)
        return await self.stats.snapshot()

    async def snapshot(self) -> Snapshot:
        assert self.stats is not None, "open() first"
        return await self.stats.snapshot()

    async def document(self, snap: Snapshot, previous: Snapshot | None) -> dict[str, Any]:
        assert self.edges_kv is not None, "open() first"
        edges = edges_registry.summary(await edges_registry.read_all(self.edges_kv), time.time())
        return document(self.config, snap, previous, await _queue_modes(self.config),
                        None if self.data_dir is None else read_state(self.data_dir),
                        await _batches(self.js, self.config), edges)


# What a NATS that went away (stopped, restarted, unreachable) raises at a
# reader: the client's errors (closed connection, timeouts, no responders),
# a socket's, and connect_once's BrokerError when it is not back yet.
# asyncio.TimeoutError is TimeoutError, an OSError.
_NATS_LOST: tuple[type[BaseException], ...] = (nats.errors.Error, OSError, BrokerError)


async def _close(nc: NATS | None) -> None:
    """Close a client that may already be closed by the server's going away."""
    if nc is not None and not nc.is_closed:
        with contextlib.suppress(*_NATS_LOST):
            await nc.close()


def _why(exc: BaseException, url: str) -> str:
    """The reason in a few words (the URL is already in the line)."""
    if isinstance(exc, BrokerError):
        return str(exc).removeprefix(f"cannot reach NATS at {url}: ")
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text}" if text and text != type(exc).__name__ \
        else type(exc).__name__


async def _once(config: Config, as_json: bool, interval: float, out: IO[str],
                data_dir: Path | None, width: int | None) -> int:
    """One document: two samples ``interval`` apart. A NATS lost in between
    is a one-line error (exit 1), like one that was never there."""
    nc = await connect_once(config.nats, "tidegate-status")
    try:
        source = Source(nc, config, data_dir)
        previous = await source.open()
        await asyncio.sleep(interval)
        doc = await source.document(await source.snapshot(), previous)
    except _NATS_LOST as exc:
        raise BrokerError(f"lost NATS at {config.nats.url}: {_why(exc, config.nats.url)}") from None
    finally:
        await _close(nc)
    if as_json:
        out.write(json.dumps(doc, indent=2) + "\n")
    else:
        out.write(status_view.render(doc, width or _Screen(out).width()))
    out.flush()
    return 0


class _Screen:
    """Where the live view goes. A terminal is redrawn in place at its current
    width; a pipe or file gets each frame after the last, and a NATS outage
    as one line when it starts and one when it ends (not one per retry)."""

    def __init__(self, out: IO[str], width: int | None = None,
                 rows: int | None = None) -> None:
        self.out = out
        self.tty = out.isatty()
        self.fixed = width
        self.rows = rows

    def width(self) -> int:
        # COLUMNS first, then the terminal; 160 for a pipe (a log, a test).
        return self.fixed or shutil.get_terminal_size((160, 24)).columns

    def frame(self, text: str) -> None:
        if not self.tty:
            self.out.write(text + "\n")
            self.out.flush()
            return
        lines = text.rstrip("\n").split("\n")
        # At most rows - 1 lines, each ending in a newline: one more would
        # scroll the top of the frame away, and the next redraw from "home"
        # would leave torn copies in the scrollback. Rows are cut, never cells.
        rows = max(3, (self.rows or shutil.get_terminal_size((160, 24)).lines) - 1)
        if len(lines) > rows:
            hidden = len(lines) - rows + 1
            lines = [*lines[:rows - 1],
                     f"(+{hidden} lines: a taller terminal shows them, or --once)"]
        # Home, each line clearing its old tail, then clear below: no flicker.
        self.out.write("\x1b[H" + "".join(f"{line}\x1b[K\n" for line in lines) + "\x1b[J")
        self.out.flush()

    def note(self, line: str) -> None:
        """A line a pipe keeps (the next frame redraws a terminal anyway)."""
        if not self.tty:
            self.out.write(line + "\n")
            self.out.flush()

    def problem(self, line: str, first: bool) -> None:
        if self.tty:
            self.frame("\n".join(status_view.wrap(line, self.width())) + "\n")
        elif first:
            self.out.write(line + "\n")
            self.out.flush()


async def _watch(config: Config, interval: float, screen: _Screen,
                 data_dir: Path | None) -> int:
    """The live view until Ctrl-C. NATS not there at the start: a one-line
    error (exit 1), as before. NATS gone later (the stack stopped or
    restarted): say so, retry every ``interval``, and carry on when it is
    back; never a traceback."""
    url = config.nats.url
    nc: NATS | None = await connect_once(config.nats, "tidegate-status")
    lost: float | None = None  # when NATS went away; None while connected
    try:
        while True:
            try:
                if nc is None:
                    nc = await connect_once(config.nats, "tidegate-status")
                source = Source(nc, config, data_dir)
                previous = await source.open()
                if lost is not None:
                    screen.note(f"tidegate status: NATS at {url} is back after "
                                f"{status_view.age(time.time() - lost)}")
                lost = None
                screen.frame(status_view.render(await source.document(previous, None),
                                                screen.width()))
                while True:
                    await asyncio.sleep(interval)
                    snap = await source.snapshot()
                    doc = await source.document(snap, previous)
                    previous = snap
                    screen.frame(status_view.render(doc, screen.width()))
            except _NATS_LOST as exc:
                first = lost is None
                lost = time.time() if lost is None else lost
                since = time.strftime("%H:%M:%S", time.localtime(lost))
                screen.problem(f"tidegate status: lost NATS at {url} at {since} "
                               f"({_why(exc, url)}); reconnecting every {interval:g}s, "
                               "Ctrl-C quits", first)
                await _close(nc)
                nc = None
                await asyncio.sleep(interval)
    finally:  # Ctrl-C cancels the loop: still say goodbye to the server
        await _close(nc)


def run(config: Config, as_json: bool = False, once: bool = False,
        interval: float | None = None, out: IO[str] | None = None,
        data_dir: Path | None = None, width: int | None = None) -> int:
    """``tidegate status``; the exit code. Ctrl-C ends the live view (0).

    ``data_dir``: where a ``tidegate up`` keeps its process state file;
    ``width``: the view's width (default: the terminal's, 160 off one).
    """
    wait = interval if interval is not None else (1.0 if as_json or once else 2.0)
    stream = out or sys.stdout
    try:
        if as_json or once:
            return asyncio.run(_once(config, as_json, wait, stream, data_dir, width))
        return asyncio.run(until_interrupted(
            _watch(config, wait, _Screen(stream, width), data_dir)))
    except KeyboardInterrupt:
        return 0


async def until_interrupted(body: Coroutine[Any, Any, int], *, grace: float = 2.0) -> int:
    """Run the live view until it ends or Ctrl-C (SIGINT), which ends it in
    at most ``grace`` seconds (0). asyncio's own Ctrl-C cancels the view's
    task once; a library call that swallows that one cancellation (the view
    waits in nats-py, redis-py and JetStream calls while NATS comes and
    goes) kept the view running, deaf to Ctrl-C. Here the task is cancelled
    again until it ends."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGINT, stop.set)
    task = asyncio.ensure_future(body)
    stopper = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({task, stopper}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        deadline = loop.time() + grace
        while not task.done() and loop.time() < deadline:
            task.cancel()
            await asyncio.wait({task}, timeout=0.1)
        return 0
    finally:
        stopper.cancel()
        loop.remove_signal_handler(signal.SIGINT)
