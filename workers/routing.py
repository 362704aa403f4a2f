"""Serving one replica of a model with several: the worker's part.

A worker of replica R of model M pulls from R's own queue (jobs routed to R)
and M's shared queue with one set of slots; the own queue always keeps a pull
outstanding while a slot is free. Pulls cannot be taken back, so in-flight may
pass the slot count by the shared pulls outstanding, for at most
``SHARED_PULL_EXPIRES``.

A job carrying ``Tg-Claim`` (routed, maybe with a fallback copy) is claimed by an
atomic KV create before it runs; the losing copy is dropped. A job with an
affinity key makes this replica its home (a plain publish: soft state).
Docs: docs/routing.md.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js.kv import KeyValue

from tidegate.broker.pull import Puller
from tidegate.control.workers_registry import ReplicaSlot
from tidegate.wire.affinity import AFFINITY_HEADER, CLAIM_HEADER, ROUTE_HEADER, Reason, home_key
from tidegate.wire.subjects import Subjects
from workers.backends.load_probe import BackendLoad, LoadProbe
from workers.replicas import Breaker

log = logging.getLogger("tidegate.worker")


#: The routes that sent a job to its conversation's home replica.
AT_HOME = frozenset({Reason.HOME.value, Reason.HOME_WAIT.value})

# How often a worker asks the claims bucket again while it does not answer.
CLAIM_RETRY = 0.25


class Claim:
    RUN = "run"          # claimed (or our own claim, on a redelivery): run it
    DROP = "drop"        # the other copy has it: ack and drop this one
    RETRY = "retry"      # the claims bucket did not answer: leave it for redelivery


@dataclass(slots=True)
class ReplicaPullers:
    """The two pullers of one replica, sharing its slots."""

    model: str
    replica: str
    capacity: int
    own: Puller | None = None
    shared: Puller | None = None
    jobs: int = 0
    hits: int = 0
    pullers: list[Puller] = field(default_factory=list)
    on_change: Callable[[str], None] | None = None  # called with the model name
    probe: LoadProbe | None = None  # the backend's own load report, where it gives one
    breaker: Breaker | None = None  # the replica's circuit breaker (workers.replicas)
    # Measured here, for the dispatchers' choice of waiting for a full home
    # (docs/routing.md): moving means of a job's time in a slot, and of the
    # time to first token and prompt length of jobs away from their home; a
    # floor under every job's time to first token (the part no cache saves);
    # and when each running job started (request id -> monotonic time).
    service_s: float | None = None
    cold_ttft_s: float | None = None
    cold_chars: float | None = None
    ttft_floor_s: float | None = None
    samples: int = 0  # jobs in service_s
    cold_samples: int = 0  # jobs in cold_ttft_s and cold_chars
    running: dict[str, float] = field(default_factory=dict)

    @property
    def busy(self) -> int:
        return sum(p.busy for p in self.pullers)

    def own_credit(self, puller: Puller) -> int:
        """What the own queue holds (one more than it had waiting at the last
        delivery), up to the free slots; at least one request outstanding while
        any slot is free, so a routed job starts at once. Asking for one at a
        time made a burst of routed turns start one pull round trip apart."""
        free = self.capacity - self.busy
        if free <= 0:
            return 0
        return min(free, 1 + puller.pending) - puller.outstanding

    def shared_credit(self, puller: Puller) -> int:
        return self.capacity - self.busy - puller.outstanding

    def on_done(self) -> None:
        # A slot freed by either puller's job is credit for both.
        for puller in self.pullers:
            puller.wake()
        self.changed()

    def changed(self) -> None:
        if self.on_change is not None:
            self.on_change(self.model)

    def started(self, request_id: str) -> None:
        self.running[request_id] = time.monotonic()

    def observe(self, request_id: str, ttft_s: float | None, chars: int, cold: bool) -> None:
        """A job ended. One that ended normally (``ttft_s`` given) is a
        sample: its time in the slot, its first token after ``ttft_s`` for
        a prompt of ``chars``; ``cold``: it was not routed to its home, so
        the replica most likely prefilled all of it."""
        started = self.running.pop(request_id, None)
        if started is None or ttft_s is None:
            return
        self.samples += 1
        self.service_s = _moving(self.service_s, time.monotonic() - started, self.samples)
        # Drops at once, rises slowly (slower than the means move): the
        # fastest first token seen lately.
        floor = self.ttft_floor_s
        self.ttft_floor_s = (ttft_s if floor is None or ttft_s < floor
                             else floor + FLOOR_RISE * (ttft_s - floor))
        if cold and chars > 0:
            self.cold_samples += 1
            self.cold_ttft_s = _moving(self.cold_ttft_s, ttft_s, self.cold_samples)
            self.cold_chars = _moving(self.cold_chars, float(chars), self.cold_samples)

    @property
    def prefill_s_per_char(self) -> float | None:
        """What an uncached first token costs above the floor, per prompt
        character. A ratio of means, not a mean of ratios, and the fixed
        latency taken off: a short prompt does not blow it up."""
        if self.cold_ttft_s is None or not self.cold_chars or self.ttft_floor_s is None:
            return None
        return max(0.0, self.cold_ttft_s - self.ttft_floor_s) / self.cold_chars

    def slot(self) -> ReplicaSlot:
        load = self.probe.load if self.probe is not None else BackendLoad()
        prefill = self.prefill_s_per_char
        now = time.monotonic()
        youngest = now - max(self.running.values()) if self.running else None
        return ReplicaSlot(self.capacity, self.busy, load.kv_usage, load.waiting, self.jobs,
                           self.hits, self.breaker.current(now).value if self.breaker
                           else "closed",
                           None if self.service_s is None else round(self.service_s, 4),
                           None if prefill is None else float(f"{prefill:.3g}"),
                           None if youngest is None else round(youngest, 4))


#: Weight of one job in a replica's moving means (about the last 20 jobs).
MOVING_WEIGHT = 0.05
#: How far one slower first token raises the floor (about the last 100 jobs).
FLOOR_RISE = 0.01


def _moving(mean: float | None, value: float, n: int) -> float:
    """The mean of the first 20 samples, then a moving mean of weight
    :data:`MOVING_WEIGHT`: a worker's first job (a warm-up, a cold start)
    does not stand for the replica for the next hundred."""
    if mean is None:
        return value
    return mean + max(MOVING_WEIGHT, 1.0 / n) * (value - mean)


class LoadReporter:
    """Publishes a model's replica loads on ``<p>.load.<model>`` as they change.

    One small message per job start and end, coalesced when several change
    before this task runs: a few per job, against the dozens of chunk messages
    a job sends, and fresh enough that a client's next turn, sent the moment
    its last one ended, finds the slot free. (A rate limit of even 50 ms made
    sequential turns see their own finished job as still running.)"""

    def __init__(self, nc: NATS, subjects: Subjects, worker_id: str,
                 groups: Callable[[str], Mapping[str, ReplicaPullers]]) -> None:
        self.nc = nc
        self.subjects = subjects
        self.worker_id = worker_id
        self.groups = groups
        self.draining = False
        self._dirty: set[str] = set()
        self._wake = asyncio.Event()

    def changed(self, model: str) -> None:
        self._dirty.add(model)
        self._wake.set()

    async def run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            dirty, self._dirty = self._dirty, set()
            for model in dirty:
                payload = {"worker": self.worker_id, "model": model, "draining": self.draining,
                           "replicas": {r: g.slot().encode()
                                        for r, g in self.groups(model).items()}}
                try:
                    await self.nc.publish(self.subjects.load(model),
                                          json.dumps(payload, separators=(",", ":")).encode())
                except nats.errors.Error as exc:
                    log.debug("could not publish the load of %s: %s", model, exc)


class WorkerRouting:
    """Claims and homes for the replicas this worker serves."""

    def __init__(self, nc: NATS, homes: KeyValue, claims: KeyValue, homes_bucket: str) -> None:
        self.nc = nc
        self.homes = homes
        self.claims = claims
        self._homes_subject = f"$KV.{homes_bucket}."

    async def claim_within(self, msg: Msg, request_id: str, within: float) -> str:
        """:meth:`claim`, asked again every :data:`CLAIM_RETRY` s while the
        claims bucket does not answer (its JetStream leader being elected
        after a NATS node's death: seconds), for up to ``within`` s, the job
        kept in progress meanwhile. Handing it back at once (a ``nak``)
        would cost a second per try, and a delivery each: a long enough
        outage would spend all of ``worker.max_deliver`` and lose the job."""
        deadline = time.monotonic() + within
        while True:
            verdict = await self.claim(msg, request_id)
            if verdict != Claim.RETRY or time.monotonic() >= deadline:
                return verdict
            try:
                await msg.in_progress()
            except nats.errors.Error:
                return verdict
            await asyncio.sleep(CLAIM_RETRY)

    async def claim(self, msg: Msg, request_id: str) -> str:
        copy = (msg.headers or {}).get(CLAIM_HEADER)
        if not copy:
            return Claim.RUN  # only one copy exists
        try:
            await self.claims.create(request_id, copy.encode())
            return Claim.RUN
        except nats.js.errors.KeyWrongLastSequenceError:
            pass
        except (nats.errors.Error, TimeoutError) as exc:
            log.warning("cannot claim %s (%s); leaving it for redelivery", request_id, exc)
            return Claim.RETRY
        try:
            entry = await self.claims.get(request_id)
        except (nats.errors.Error, TimeoutError) as exc:
            log.warning("cannot read the claim of %s (%s); leaving it for redelivery",
                        request_id, exc)
            return Claim.RETRY
        # Our own claim: a redelivery of the copy that claimed (its worker
        # died or stalled), which runs like any redelivered job.
        return Claim.RUN if entry.value == copy.encode() else Claim.DROP

    async def note_home(self, msg: Msg, model: str, replica: str,
                        counts: ReplicaPullers) -> None:
        headers = msg.headers or {}
        key = headers.get(AFFINITY_HEADER)
        if not key:
            return
        counts.jobs += 1
        if headers.get(ROUTE_HEADER) in AT_HOME:
            counts.hits += 1
        # A plain publish to the KV subject is a put without waiting for the
        # ack: a lost home costs one cache miss, not correctness.
        try:
            await self.nc.publish(self._homes_subject + home_key(model, key), replica.encode())
        except nats.errors.Error as exc:
            log.debug("could not record the home of %s: %s", key, exc)
