"""Queue depth per model, read from JetStream, and the live-worker registry.

One model's jobs are ``<p>.job.<model>`` in ``<P>_JOBS``, pulled through
``workers_<model>``: ``waiting`` is the consumer's ``num_pending``, ``running``
its ``num_ack_pending``, ``depth`` their sum, ``oldest_age`` the age of the
first job never delivered (its envelope's ``created_ms``). Before any worker
made the consumer, the stream's per-subject count stands in for ``waiting``.

A :class:`QueueStats` polls every few seconds and keeps the last
:class:`Snapshot`; gauges read that snapshot, so a scrape never waits for NATS.
Docs: docs/observability.md.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import msgpack
import nats.errors
import nats.js.errors
from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from tidegate.config import Config, ModelConfig
from tidegate.control import workers_registry
from tidegate.control.workers_registry import WorkerInfo
from tidegate.telemetry import telemetry as tm

log = logging.getLogger("tidegate.queue_stats")


async def jobs_of(js: JetStreamContext, config: Config, model: ModelConfig) -> tuple[int, int]:
    """(waiting, running) of a model's jobs now: ``num_pending`` and
    ``num_ack_pending`` of its queue's consumer and each replica's (routing
    homes). A consumer no worker has made yet, or that does not answer,
    counts nothing."""
    subjects = config.nats.subjects
    consumers = [subjects.worker_consumer(model.name)]
    if len(model.replicas) > 1:
        consumers += [subjects.replica_consumer(model.name, r) for r in model.replica_names]
    waiting = running = 0
    for consumer in consumers:
        try:
            info = await js.consumer_info(subjects.jobs_stream, consumer)
        except Exception:
            continue
        waiting += int(info.num_pending or 0)
        running += int(info.num_ack_pending or 0)
    return waiting, running

POLL_INTERVAL = 5.0


@dataclass(frozen=True, slots=True)
class ModelQueue:
    model: str
    waiting: int = 0  # num_pending
    running: int = 0  # num_ack_pending
    oldest_age: float = 0.0  # seconds; 0 when nothing waits
    delivered: int = 0  # deliveries so far (consumer sequence), for rates
    redelivered: int = 0  # num_redelivered
    consumer: bool = False  # the workers_<model> consumer exists

    @property
    def depth(self) -> int:
        return self.waiting + self.running


@dataclass(frozen=True, slots=True)
class Snapshot:
    taken: float  # unix seconds
    models: tuple[ModelQueue, ...]
    backlog: int = 0  # requests waiting for a dispatcher
    requests_total: int = 0  # last sequence of <P>_REQUESTS, for rates
    finished: dict[str, int] = field(default_factory=dict)  # usage records per model, ever
    workers: tuple[WorkerInfo, ...] = ()


class QueueStats:
    def __init__(self, js: JetStreamContext, config: Config,
                 registry: KeyValue | None = None) -> None:
        self.js = js
        self.config = config
        self.subjects = config.nats.subjects
        self.registry = registry
        self.last: Snapshot | None = None

    async def model_queue(self, model: str) -> ModelQueue:
        subjects = self.subjects
        subject = subjects.job(model)
        try:
            info = await self.js.consumer_info(subjects.jobs_stream,
                                               subjects.worker_consumer(model))
        except nats.js.errors.NotFoundError:
            waiting = await self._subject_count(subjects.jobs_stream, subject)
            age = await self._oldest_age(subject, 1) if waiting else 0.0
            return ModelQueue(model, waiting=waiting, oldest_age=age)
        waiting = int(info.num_pending or 0)
        start = (info.delivered.stream_seq or 0) + 1 if info.delivered else 1
        age = await self._oldest_age(subject, start) if waiting else 0.0
        return ModelQueue(model, waiting=waiting, running=int(info.num_ack_pending or 0),
                          oldest_age=age,
                          delivered=int(info.delivered.consumer_seq or 0) if info.delivered
                          else 0,
                          redelivered=int(info.num_redelivered or 0), consumer=True)

    async def _subject_count(self, stream: str, subject: str) -> int:
        try:
            info = await self.js.stream_info(stream, subjects_filter=subject)
        except nats.js.errors.NotFoundError:
            return 0
        return int((info.state.subjects or {}).get(subject, 0))

    async def _oldest_age(self, subject: str, start_seq: int) -> float:
        try:
            msg = await self.js.get_msg(self.subjects.jobs_stream, seq=start_seq,
                                        subject=subject, next=True)
        except nats.js.errors.NotFoundError:
            return 0.0
        created_ms = _created_ms(msg.data)
        if created_ms:
            return max(0.0, time.time() - created_ms / 1000)
        if msg.time is not None:
            return max(0.0, time.time() - msg.time.timestamp())
        return 0.0

    async def snapshot(self) -> Snapshot:
        models = tuple([await self.model_queue(m.name) for m in self.config.models])
        subjects = self.subjects
        backlog = requests_total = 0
        try:
            info = await self.js.consumer_info(subjects.requests_stream,
                                               subjects.dispatcher_consumer)
            backlog = int(info.num_pending or 0) + int(info.num_ack_pending or 0)
        except nats.js.errors.NotFoundError:
            backlog = await self._stream_messages(subjects.requests_stream)
        try:
            stream = await self.js.stream_info(subjects.requests_stream)
            requests_total = int(stream.state.last_seq or 0)
        except nats.js.errors.NotFoundError:
            pass
        finished: dict[str, int] = {}
        try:
            usage = await self.js.stream_info(subjects.usage_stream,
                                              subjects_filter=subjects.usage_wildcard)
            counts = usage.state.subjects or {}
            finished = {m.name: int(counts.get(subjects.usage(m.name), 0))
                        for m in self.config.models}
        except nats.js.errors.NotFoundError:
            pass
        workers: tuple[WorkerInfo, ...] = ()
        if self.registry is not None:
            workers = tuple(await workers_registry.read_all(self.registry))
        self.last = Snapshot(time.time(), models, backlog, requests_total, finished, workers)
        return self.last

    async def _stream_messages(self, stream: str) -> int:
        try:
            return int((await self.js.stream_info(stream)).state.messages or 0)
        except nats.js.errors.NotFoundError:
            return 0

    # -- metrics -----------------------------------------------------------------

    def register(self, metrics: tm.Metrics) -> None:
        """Feed the queue and fleet gauges from the last snapshot."""

        def per_model(value: str) -> Iterable[tuple[float, tm.Attributes]]:
            snap = self.last
            if snap is None:
                return ()
            return [(float(getattr(q, value)), {tm.MODEL: q.model}) for q in snap.models]

        metrics.observe_queues(
            depth=lambda: per_model("depth"),
            waiting=lambda: per_model("waiting"),
            oldest_age=lambda: per_model("oldest_age"),
            backlog=lambda: () if self.last is None else ((float(self.last.backlog), {}),),
            workers=self._workers_live,
            fleet_slots=self._fleet_slots,
        )

    def _workers_live(self) -> Iterable[tuple[float, tm.Attributes]]:
        snap = self.last
        if snap is None or self.registry is None:
            return ()
        return [(float(sum(1 for w in snap.workers if m.name in w.models)), {tm.MODEL: m.name})
                for m in self.config.models]

    def _fleet_slots(self) -> Iterable[tuple[float, tm.Attributes]]:
        snap = self.last
        if snap is None or self.registry is None:
            return ()
        out: list[tuple[float, tm.Attributes]] = []
        for m in self.config.models:
            slots = [w.models[m.name] for w in snap.workers if m.name in w.models]
            used = sum(s.in_flight for s in slots)
            free = sum(s.free for s in slots)
            out.append((float(used), {tm.MODEL: m.name, tm.SLOT_STATE: "used"}))
            out.append((float(free), {tm.MODEL: m.name, tm.SLOT_STATE: "free"}))
        return out

    async def run(self, stop: asyncio.Event, interval: float = POLL_INTERVAL) -> None:
        """Poll until ``stop``; never raises (a NATS outage only makes the
        gauges go stale, and the next poll after it recovers fixes them)."""
        while not stop.is_set():
            try:
                await self.snapshot()
            except (nats.errors.Error, TimeoutError, OSError) as exc:
                log.warning("queue stats poll failed: %s", exc)
            except Exception:
                log.exception("queue stats poll failed")
            try:
                async with asyncio.timeout(interval):
                    await stop.wait()
            except TimeoutError:
                pass


def _created_ms(data: bytes | None) -> int:
    """``created_ms`` of a Request envelope, without decoding the whole body
    strictly (an unreadable one only loses its age)."""
    if not data:
        return 0
    try:
        envelope = msgpack.unpackb(data)
    except Exception:
        return 0
    value = envelope.get("created_ms") if isinstance(envelope, dict) else None
    return int(value) if isinstance(value, int) else 0
