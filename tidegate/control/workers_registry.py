"""The ``<P>_WORKERS`` KV bucket: which workers are alive, and their slots.

Every worker puts one entry (key: its worker id, value: JSON) every
:data:`HEARTBEAT` seconds; the bucket's TTL is :data:`TTL`, so a worker that
died without saying goodbye disappears within that time, and one that stops
cleanly deletes its entry at once. Dispatchers read it for the fleet gauges
(``tidegate.workers.live``, which is what a "worker pool empty" alert needs:
a worker that is gone exports nothing itself), and ``tidegate status`` shows
it.

The value is advisory (a few seconds old at most); nothing routes work by
it. Work goes to workers only through their pull consumers.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from tidegate.config import Config
from tidegate.control import registry

log = logging.getLogger("tidegate.worker")

HEARTBEAT = 5.0  # seconds between a worker's puts
TTL = 15.0  # an entry not refreshed for this long is gone: three missed heartbeats


@dataclass(frozen=True, slots=True)
class SlotInfo:
    slots: int  # with adaptive concurrency: the worker's current limit
    in_flight: int
    adaptive: bool = False  # max_streams = "auto": slots moves with the backend's latency

    @property
    def free(self) -> int:
        return max(0, self.slots - self.in_flight)


@dataclass(frozen=True, slots=True)
class ReplicaSlot:
    """One backend replica of a model as this worker serves it (models with
    several replicas, docs/routing.md). ``kv_usage`` (0..1) and ``waiting``
    are what the backend reports about itself, None where it reports nothing;
    ``hits`` of ``jobs`` reached this replica as their conversation's home."""

    slots: int
    in_flight: int
    kv_usage: float | None = None
    waiting: int | None = None
    jobs: int = 0
    hits: int = 0
    # The worker's circuit breaker for this replica (workers.replicas):
    # "closed", "open" (failing: no new work) or "half_open" (one probe).
    breaker: str = "closed"
    # Measured by the worker (None until it has): a job's mean time in a slot,
    # the time to first token per prompt character of jobs away from their
    # home, and the age of the youngest job running (None: none runs) when
    # this was sent (docs/routing.md: when a full home is worth waiting for).
    service_s: float | None = None
    prefill_s_per_char: float | None = None
    youngest_s: float | None = None

    def encode(self) -> dict[str, Any]:
        return {"slots": self.slots, "in_flight": self.in_flight, "kv_usage": self.kv_usage,
                "waiting": self.waiting, "jobs": self.jobs, "hits": self.hits,
                "breaker": self.breaker, "service_s": self.service_s,
                "prefill_s_per_char": self.prefill_s_per_char, "youngest_s": self.youngest_s}

    @classmethod
    def decode(cls, raw: Mapping[str, Any]) -> ReplicaSlot:
        kv, waiting = raw.get("kv_usage"), raw.get("waiting")
        return cls(int(raw["slots"]), int(raw["in_flight"]),
                   None if kv is None else float(kv), None if waiting is None else int(waiting),
                   int(raw.get("jobs", 0)), int(raw.get("hits", 0)),
                   str(raw.get("breaker", "closed")),
                   _seconds(raw, "service_s"), _seconds(raw, "prefill_s_per_char"),
                   _seconds(raw, "youngest_s"))


def _seconds(raw: Mapping[str, Any], name: str) -> float | None:
    """A measured time: absent, or finite and >= 0. A negative one would make
    every full home look worth waiting for (docs/routing.md): ValueError, so
    the report is dropped as malformed, as any other bad field is."""
    value = raw.get(name)
    if value is None:
        return None
    seconds = float(value)
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"{name}: expected a finite time >= 0, got {value!r}")
    return seconds


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    worker_id: str
    host: str = ""
    pid: int = 0
    started: float = 0.0  # unix seconds
    updated: float = 0.0  # unix seconds of this heartbeat
    models: Mapping[str, SlotInfo] = field(default_factory=dict)
    draining: bool = False
    # model -> replica -> its slots, for models served by several replicas
    replicas: Mapping[str, Mapping[str, ReplicaSlot]] = field(default_factory=dict)

    def encode(self) -> bytes:
        return json.dumps({
            "worker_id": self.worker_id, "host": self.host, "pid": self.pid,
            "started": self.started, "updated": self.updated, "draining": self.draining,
            "models": {m: _slot_doc(s) for m, s in self.models.items()},
            **({"replicas": {m: {r: s.encode() for r, s in rs.items()}
                             for m, rs in self.replicas.items()}} if self.replicas else {}),
        }, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, data: bytes) -> WorkerInfo:
        raw: dict[str, Any] = json.loads(data)
        models = {str(m): SlotInfo(int(s["slots"]), int(s["in_flight"]),
                                   bool(s.get("adaptive", False)))
                  for m, s in (raw.get("models") or {}).items()}
        replicas = {str(m): {str(r): ReplicaSlot.decode(s) for r, s in rs.items()}
                    for m, rs in (raw.get("replicas") or {}).items()}
        return cls(worker_id=str(raw["worker_id"]), host=str(raw.get("host", "")),
                   pid=int(raw.get("pid", 0)), started=float(raw.get("started", 0.0)),
                   updated=float(raw.get("updated", 0.0)), models=models,
                   draining=bool(raw.get("draining", False)), replicas=replicas)


def _slot_doc(s: SlotInfo) -> dict[str, Any]:
    # "adaptive" only when set: entries of pinned models keep their old shape.
    doc: dict[str, Any] = {"slots": s.slots, "in_flight": s.in_flight}
    if s.adaptive:
        doc["adaptive"] = True
    return doc


async def ensure_bucket(js: JetStreamContext, config: Config) -> KeyValue:
    return await registry.ensure_bucket(js, config, config.nats.subjects.workers_bucket,
                                        "tidegate: live workers and their slots", TTL)


async def heartbeat(kv: KeyValue, snapshot: Callable[[], WorkerInfo],
                    interval: float = HEARTBEAT, wake: asyncio.Event | None = None) -> None:
    """Put ``snapshot()`` every ``interval`` (and early, at most every
    ``registry.EARLY_SPACING``, when ``wake`` is set) until cancelled, then
    delete the entry (:func:`tidegate.control.registry.heartbeat`)."""
    await registry.heartbeat(kv, snapshot, lambda i: i.worker_id, interval, "worker", wake)


def local_info(worker_id: str, started: float, slots: Mapping[str, SlotInfo],
               draining: bool = False,
               replicas: Mapping[str, Mapping[str, ReplicaSlot]] | None = None) -> WorkerInfo:
    return WorkerInfo(worker_id=worker_id, host=socket.gethostname(), pid=os.getpid(),
                      started=started, updated=time.time(), models=dict(slots),
                      draining=draining, replicas=dict(replicas or {}))


async def read_all(kv: KeyValue, max_age: float = TTL) -> list[WorkerInfo]:
    """Every live worker, by worker id, once each (the newest entry of a key;
    see :func:`tidegate.control.registry.read_live`)."""
    return await registry.read_live(kv, WorkerInfo.decode, lambda i: i.worker_id, max_age, "worker")
