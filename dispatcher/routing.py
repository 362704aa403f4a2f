"""Cache-aware routing across a model's backend replicas: the dispatcher's part.

A model with several ``base_urls`` has, besides its shared queue, one queue per
replica (``<p>.job.<model>.<replica>``), pulled first by that replica's workers.
Per job the dispatcher derives the affinity key once, looks up its home
(``<P>_AFFINITY``, with a TTL) and lets :func:`tidegate.wire.affinity.choose`
decide from the replicas' load.

Invariants: no wait behind a busy replica (a full home goes to the shared
queue; a routed job unclaimed within ``routing.max_affinity_wait`` gets a copy
there); exactly one run (copies carry ``Tg-Claim``, and a worker claims in
``<P>_CLAIMS`` by atomic create before it runs); nothing lost when a dispatcher
dies (the job stays in its replica's queue). Docs: docs/routing.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import OrderedDict, deque
from collections.abc import Mapping
from dataclasses import dataclass

import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from tidegate import apis
from tidegate.config import Config, ModelConfig
from tidegate.control.workers_registry import TTL, ReplicaSlot, WorkerInfo
from tidegate.telemetry import telemetry as tm
from tidegate.wire.affinity import (
    AFFINITY_HEADER,
    CLAIM_FALLBACK,
    CLAIM_HEADER,
    CLAIM_ROUTED,
    ROUTE_HEADER,
    Reason,
    ReplicaLoad,
    Route,
    affinity_key,
    choose,
    home_key,
    reusable_chars,
)
from tidegate.wire.protocol import Request

log = logging.getLogger("tidegate.dispatcher")


@dataclass(frozen=True, slots=True)
class Routed:
    """Where one job goes, and the headers that say so."""

    subject: str
    headers: dict[str, str]
    route: Route
    key: str | None


class ReplicaView:
    """The replicas' load per model: each worker's latest report per replica,
    from its load messages (``<p>.load.<model>``, sent on every change) and its
    registry heartbeats, plus the jobs this dispatcher routed since that report.

    Times are this process's monotonic clock at receipt, so clock skew
    between machines does not matter."""

    def __init__(self, config: Config) -> None:
        self.models = {m.name: m for m in config.models if len(m.replicas) > 1}
        # (worker, model, replica) -> (its latest slot report, when received)
        self.slots: dict[tuple[str, str, str], tuple[ReplicaSlot, float]] = {}
        self._routed: dict[tuple[str, str], deque[float]] = {}

    def on_put(self, key: str, value: bytes) -> None:
        """A registry heartbeat."""
        try:
            info = WorkerInfo.decode(value)
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("ignoring malformed worker entry %s: %s", key, exc)
            return
        self.on_delete(key)
        if info.draining or time.time() - info.updated > TTL:
            return
        for model, replicas in info.replicas.items():
            self.update(key, model, replicas)

    def on_delete(self, key: str) -> None:
        for k in [k for k in self.slots if k[0] == key]:
            del self.slots[k]

    def on_load(self, data: bytes) -> None:
        """A worker's load message: ``{"worker", "model", "draining", "replicas"}``."""
        try:
            raw = json.loads(data)
            worker, model = str(raw["worker"]), str(raw["model"])
            replicas = {str(r): ReplicaSlot.decode(s) for r, s in raw["replicas"].items()}
            draining = bool(raw.get("draining", False))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            log.warning("ignoring malformed load message: %s", exc)
            return
        if draining:
            self.on_delete(worker)
            return
        self.update(worker, model, replicas)

    async def on_load_msg(self, msg: Msg) -> None:
        self.on_load(msg.data)

    def update(self, worker: str, model: str, replicas: Mapping[str, ReplicaSlot]) -> None:
        now = time.monotonic()
        for replica, slot in replicas.items():
            self.slots[(worker, model, replica)] = (slot, now)

    def routed(self, model: str, replica: str) -> None:
        self._routed.setdefault((model, replica), deque()).append(time.monotonic())

    def loads(self, model: ModelConfig) -> list[ReplicaLoad]:
        """Each replica of ``model`` summed over its live workers (its
        measured times: their mean over the workers that measured them)."""
        now = time.monotonic()
        totals = {r: _Total() for r in model.replica_names}
        for (_worker, m, replica), (slot, received) in list(self.slots.items()):
            t = totals.get(replica)
            if m != model.name or t is None or now - received > TTL:
                continue
            if slot.breaker == "open":
                continue  # that worker's breaker took the replica out: no slots there
            t.add(slot, received, now)
        out = []
        for replica, t in totals.items():
            in_flight = t.in_flight
            recent = self._routed.get((model.name, replica))
            if recent is not None:
                # Jobs routed after the replica's latest report are not in it.
                while recent and (recent[0] <= t.reported or now - recent[0] > TTL):
                    recent.popleft()
                in_flight += len(recent)
            out.append(ReplicaLoad(replica, in_flight, t.slots, t.kv_usage, t.waiting,
                                   _mean(t.service), _mean(t.prefill), t.youngest))
        return out


class _Total:
    """One replica's reports summed over its workers."""

    __slots__ = ("in_flight", "kv_usage", "prefill", "reported", "service", "slots", "waiting",
                 "youngest")

    def __init__(self) -> None:
        self.in_flight = self.slots = 0
        self.kv_usage: float | None = None
        self.waiting: int | None = None
        self.reported = 0.0
        self.service: list[float] = []
        self.prefill: list[float] = []
        self.youngest: float | None = None  # over all its workers, aged to now

    def add(self, slot: ReplicaSlot, received: float, now: float) -> None:
        self.in_flight += slot.in_flight
        self.slots += slot.slots
        if slot.kv_usage is not None:  # one backend: its workers see the same
            self.kv_usage = max(self.kv_usage or 0.0, slot.kv_usage)
        if slot.waiting is not None:
            self.waiting = max(self.waiting or 0, slot.waiting)
        if slot.service_s is not None:
            self.service.append(slot.service_s)
        if slot.prefill_s_per_char is not None:
            self.prefill.append(slot.prefill_s_per_char)
        if slot.youngest_s is not None:
            # No job has started there since (that would have been reported):
            # the youngest has aged by the time since the report.
            age = slot.youngest_s + (now - received)
            self.youngest = age if self.youngest is None else min(self.youngest, age)
        self.reported = max(self.reported, received)


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


class HomeCache:
    """The ``<P>_AFFINITY`` bucket as this dispatcher follows it: key -> home.

    Read on every routed request, so no KV round trip sits on the dispatch
    path (a get per request cost a NATS round trip each, which showed at 200
    concurrent chats). The bucket's TTL removes entries without telling
    watchers, so the cache applies ``routing.home_ttl`` itself: entries are
    kept in the order they were last written and dropped from the old end,
    which bounds it by the conversations active within the TTL."""

    def __init__(self, ttl: float) -> None:
        self.ttl = ttl
        self._homes: OrderedDict[str, tuple[str, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._homes)

    def on_put(self, key: str, value: bytes) -> None:
        now = time.monotonic()
        self._homes[key] = (value.decode(errors="replace"), now)
        self._homes.move_to_end(key)
        while self._homes:
            _, (_, written) = next(iter(self._homes.items()))
            if now - written <= self.ttl:
                break
            self._homes.popitem(last=False)

    def on_delete(self, key: str) -> None:
        self._homes.pop(key, None)

    def get(self, key: str) -> str | None:
        entry = self._homes.get(key)
        if entry is None or time.monotonic() - entry[1] > self.ttl:
            return None
        return entry[0]


class Router:
    def __init__(self, config: Config, nc: NATS, js: JetStreamContext, homes: KeyValue,
                 claims: KeyValue, view: ReplicaView) -> None:
        self.config = config
        self.cfg = config.routing
        self.nc = nc
        self.js = js
        self.homes = homes
        self.home_cache = HomeCache(config.routing.home_ttl)
        self.claims = claims
        self.view = view
        self.subjects = config.nats.subjects
        self.metrics = tm.get().metrics
        self.tasks: set[asyncio.Task[None]] = set()  # fallback timers
        self.metrics.observe_replicas(self._observe)

    def _observe(self) -> list[tuple[float, tm.Attributes]]:
        return [(float(load.in_flight), {tm.MODEL: model.name, tm.REPLICA: load.name})
                for model in self.view.models.values() for load in self.view.loads(model)]

    def applies(self, model: ModelConfig | None) -> bool:
        return (model is not None and self.cfg.affinity == "auto"
                and model.name in self.view.models)

    async def route(self, request: Request, model: ModelConfig) -> Routed:
        key = affinity_key(apis.of(request.api).affinity_field, request.body,
                           user=self.cfg.key_user, prefix_bytes=self.cfg.prefix_bytes)
        home = self.home_cache.get(home_key(model.name, key)) if key is not None else None
        loads = self.view.loads(model)
        route = choose(key, home, loads,
                       reusable=reusable_chars(request.body) if home is not None else 0,
                       max_wait=self.cfg.max_affinity_wait)
        log.debug("routing %s: key %s, home %s, loads %s -> %s", request.id, key, home, loads,
                  route)
        headers: dict[str, str] = {ROUTE_HEADER: str(route.reason)}
        if key is not None:
            headers[AFFINITY_HEADER] = key
        if route.replica is not None:
            self.view.routed(model.name, route.replica)
            headers[CLAIM_HEADER] = CLAIM_ROUTED
            subject = self.subjects.job_replica(model.name, route.replica)
        else:
            subject = self.subjects.job(model.name)
        hit = "hit" if route.reason in (Reason.HOME, Reason.HOME_WAIT) else "miss"
        self.metrics.affinity_routes.add(1, {tm.MODEL: model.name, tm.OUTCOME: hit,
                                             tm.ROUTE_REASON: str(route.reason)})
        return Routed(subject, headers, route, key)

    def schedule_fallback(self, request: Request, data: bytes, headers: dict[str, str],
                          routed: Routed) -> None:
        """After the job went to a replica's queue: a copy on the shared queue
        if nobody claimed it within ``routing.max_affinity_wait``."""
        task = asyncio.create_task(self._fallback(request, data, headers, routed))
        self.tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        self.tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("affinity fallback failed", exc_info=task.exception())

    async def _fallback(self, request: Request, data: bytes, headers: dict[str, str],
                        routed: Routed) -> None:
        await asyncio.sleep(self.cfg.max_affinity_wait)
        if request.deadline_ms < time.time() * 1000:
            return
        try:
            await self.claims.get(request.id)
            return  # claimed: it runs (or ran) on its replica
        except nats.js.errors.KeyNotFoundError:
            pass
        except (nats.errors.Error, TimeoutError) as exc:
            log.warning("cannot check the claim of %s (%s); sending a fallback copy",
                        request.id, exc)
        copy = {**headers, CLAIM_HEADER: CLAIM_FALLBACK,
                "Nats-Msg-Id": f"{request.id}.fallback"}
        try:
            await self.js.publish(self.subjects.job(request.model), data, headers=copy)
        except (nats.errors.Error, TimeoutError) as exc:
            # The routed copy is still queued at its replica: late, not lost.
            log.warning("could not publish the fallback copy of %s: %s", request.id, exc)
            return
        self.metrics.affinity_fallbacks.add(1, {tm.MODEL: request.model,
                                                tm.ROUTE_REASON: "wait"})
        log.info("request %s: not claimed by replica %s within %.2fs, copied to the shared "
                 "queue", request.id, routed.route.replica, self.cfg.max_affinity_wait)

    async def close(self) -> None:
        for task in list(self.tasks):
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*self.tasks, return_exceptions=True)
