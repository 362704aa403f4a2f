"""Adaptive concurrency (``max_streams = "auto"``, the default for an openai
backend) through the whole pipeline: real nats-server, redis-server, edge,
dispatcher and worker processes in front of the fake backend.

Three cases, as the issue puts them:

* capacity to spare: every request the clients have open runs at the
  backend at once, nothing waits in JetStream that could run;
* a backend saturating at K streams (the fake's ``saturate_at``): in-flight
  at the backend settles within [K, 1.5 K], the excess waits in JetStream as
  queue depth, and the streams admitted get a TTFT near the uncongested one;
* two workers on that backend: their sum still settles within [K, 1.5 K].

The load is closed-loop users (each sends its next request when the last one
ended), generated in the test process. Paces are slow (tens of ms per token)
so that a loaded 2-core machine's scheduling noise stays small against them.
"""

from __future__ import annotations

import asyncio
import io
import itertools
import json
import re
import statistics
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import nats
import pytest

from bench.fake_backend import FakeBackend
from fleet.run import status
from tests.pipeline import DEV_KEY, Pipeline, threaded_fake_backend
from tidegate.broker import broker
from tidegate.control import workers_registry

pytestmark = pytest.mark.pipeline

MODEL = "fake"
TTFT = 0.1
ITL = 0.05
TOKENS = 12


def _pipeline(tmp_path: Path, nats_url: str, redis_url: str, fake: FakeBackend,
              workers: int = 1, metrics: bool = False) -> Pipeline:
    # max_streams is not set: "auto" is the default for backend = "openai".
    p = Pipeline(tmp_path, nats_url, redis_url, workers=workers, metrics=metrics, overrides={
        "nats": {"subject_prefix": "a" + uuid.uuid4().hex[:8]},
        "models": [{"name": MODEL, "backend": "openai", "base_url": fake.base_url,
                    "min_streams": 2}]})
    p.start()
    return p


async def _users(url: str, n: int, until: float) -> int:
    """``n`` closed-loop users until ``until``; the number of completed requests."""
    done = 0

    async def user(session: aiohttp.ClientSession, i: int) -> None:
        nonlocal done
        while time.monotonic() < until:
            async with session.post(f"{url}/v1/chat/completions", json={
                    "model": MODEL, "stream": True,
                    "messages": [{"role": "user", "content": f"user {i}"}]},
                    headers={"Authorization": f"Bearer {DEV_KEY}"}) as resp:
                assert resp.status == 200, await resp.text()
                body = await resp.read()
            assert body.endswith(b"data: [DONE]\n\n"), body[-200:]
            done += 1

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector,
                                     timeout=aiohttp.ClientTimeout(total=120)) as session:
        await asyncio.gather(*(user(session, i) for i in range(n)))
    return done


async def _sample(fake: FakeBackend, pipeline: Pipeline, start: float, until: float,
                  ) -> tuple[list[int], list[int]]:
    """The backend's in-flight count and the jobs waiting in JetStream, every
    50 ms between ``start`` and ``until``."""
    active: list[int] = []
    waiting: list[int] = []
    nc = await nats.connect(pipeline.config.nats.url)
    try:
        js = broker.jetstream(nc, pipeline.config.nats)
        subjects = pipeline.config.nats.subjects
        await asyncio.sleep(max(0.0, start - time.monotonic()))
        while time.monotonic() < until:
            active.append(fake.active)
            info = await js.consumer_info(subjects.jobs_stream, subjects.worker_consumer(MODEL))
            waiting.append(int(info.num_pending or 0))
            await asyncio.sleep(0.05)
    finally:
        await nc.close()
    return active, waiting


async def _registry(pipeline: Pipeline) -> list[workers_registry.WorkerInfo]:
    """This pipeline's workers' registry entries (by pid: the module's
    nats-server may still hold a previous test's entry until its TTL)."""
    pids = {p.pid for p in pipeline.workers}
    nc = await nats.connect(pipeline.config.nats.url)
    try:
        js = broker.jetstream(nc, pipeline.config.nats)
        kv = await workers_registry.ensure_bucket(js, pipeline.config)
        return [w for w in await workers_registry.read_all(kv) if w.pid in pids]
    finally:
        await nc.close()


def _utilization(fake: FakeBackend, since: float) -> float:
    """How much of a slot's time it spends with a request at the backend
    rather than between two (the job ending, the next pulled and started).

    Measured from the fake's records in the same run: consecutive requests
    on one connection are one slot's turnover (the worker reuses its
    connections), so the gaps between them are the part of each slot's time
    a busy machine adds; the sampled in-flight misses those gaps."""
    by_peer: dict[str, list[tuple[float, float]]] = {}
    for r in list(fake.records):
        if r.started_at > since and r.finished_at is not None and r.peer:
            by_peer.setdefault(r.peer, []).append((r.started_at, r.finished_at))
    busy = idle = 0.0
    for spans in by_peer.values():
        spans.sort()
        busy += sum(end - start for start, end in spans)
        # A gap longer than a job is a connection left idle, not a turnover.
        longest = max(end - start for start, end in spans)
        idle += sum(gap for (_, end), (start, _) in itertools.pairwise(spans)
                    if 0 < (gap := start - end) <= longest)
    return busy / (busy + idle) if busy else 1.0


def _slots_in_use(fake: FakeBackend, active: list[int], since: float) -> float:
    """The backend's mean in-flight divided by :func:`_utilization`: what
    the limit was, on any machine."""
    return statistics.mean(active) / _utilization(fake, since)


async def _run(fake: FakeBackend, pipeline: Pipeline, users: int, seconds: float,
               settle: float) -> tuple[list[int], list[int], int]:
    now = time.monotonic()
    done, (active, waiting) = await asyncio.gather(
        _users(pipeline.url, users, now + seconds),
        _sample(fake, pipeline, now + settle, now + seconds))
    return active, waiting, done


@pytest.fixture
def spare() -> Iterator[FakeBackend]:
    with threaded_fake_backend(models=[MODEL], ttft=TTFT, itl=ITL, tokens=TOKENS) as fake:
        yield fake


@pytest.fixture
def saturating() -> Iterator[FakeBackend]:
    with threaded_fake_backend(models=[MODEL], ttft=TTFT, itl=ITL, tokens=TOKENS,
                               saturate_at=8) as fake:
        yield fake


async def test_capacity_to_spare_nothing_waits_that_could_run(
        tmp_path: Path, module_nats_url: str, module_redis_url: str,
        spare: FakeBackend) -> None:
    """96 users, more than the old fixed 64 slots and 48x the starting limit:
    the limit grows until every user's request runs at the backend at once."""
    users = 96
    pipeline = _pipeline(tmp_path, module_nats_url, module_redis_url, spare, metrics=True)
    try:
        started = time.monotonic()
        active, waiting, done = await _run(spare, pipeline, users, seconds=8.0, settle=5.0)
        workers = await _registry(pipeline)
        scraped = await asyncio.to_thread(pipeline.scrape, "worker0")
        out = io.StringIO()
        assert await asyncio.to_thread(status.run, pipeline.config, True, False, 0.3, out) == 0
        view = io.StringIO()
        assert await asyncio.to_thread(status.run, pipeline.config, False, True, 0.3, view) == 0
    finally:
        pipeline.stop()
    # `tidegate status` shows the limit: the model's slots are adaptive, and
    # their total is the worker's current limit.
    (model,) = json.loads(out.getvalue())["models"]
    assert model["adaptive"] is True
    assert model["slots"]["total"] >= users
    assert " auto" in view.getvalue()
    # The limit is a metric too.
    gauge = re.search(r'^tidegate_worker_concurrency_limit\{[^}]*tidegate_slot_mode="auto"[^}]*\}'
                      r" ([0-9.e+]+)$", scraped, re.M)
    assert gauge is not None, scraped[:2000]
    assert float(gauge.group(1)) >= users
    assert done > users, pipeline.logs()
    assert spare.peak_active == users
    # Settled: what waits in JetStream is the odd request between its edge
    # and a worker, not a backlog the backend could have run. A busy machine
    # stretches each request's trip from the client through edge, JetStream
    # and worker (the turnover a slot spends between two jobs, measured in
    # this run), and a request on that trip is neither at the backend nor,
    # for part of it, out of JetStream: both bounds allow for that share.
    between = 1.0 - _utilization(spare, started + 5.0)
    assert statistics.median(waiting) <= users * (0.05 + between), (between, waiting)
    assert statistics.mean(active) >= users * (0.8 - between), (between, active)
    (worker,) = workers
    slots = worker.models[MODEL]
    assert slots.adaptive
    assert slots.slots >= users


async def test_saturating_backend_in_flight_settles_within_k_and_1_5k(
        tmp_path: Path, module_nats_url: str, module_redis_url: str,
        saturating: FakeBackend) -> None:
    k, users = 8, 32
    pipeline = _pipeline(tmp_path, module_nats_url, module_redis_url, saturating)
    try:
        started = time.monotonic()
        active, waiting, done = await _run(saturating, pipeline, users, seconds=12.0,
                                           settle=6.0)
    finally:
        pipeline.stop()
    assert done > users, pipeline.logs()
    mean = statistics.mean(active)
    # Never above 1.5 K; at least K once the slots' turnover on this machine
    # is counted (a busy machine stretches the gaps between a slot's jobs,
    # which lowers the sampled in-flight, not the limit).
    assert mean <= 1.5 * k, (mean, active)
    assert _slots_in_use(saturating, active, started + 6.0) >= k, (mean, active)
    # The excess waits in JetStream, visible as queue depth.
    assert statistics.median(waiting) >= (users - 1.5 * k) / 2, waiting
    # Streams admitted in the settled part see a TTFT near the uncongested
    # one (at 1.5 K the fake's is 1.5x); pinned at 32 it would be 4x. Judged
    # on the slow-down the fake paced each first token with, not the time
    # measured: a busy machine's scheduling delays are not the backend's
    # congestion, and would count against the limiter.
    slowdowns = [r.slowdown for r in saturating.records
                 if r.first_byte_at is not None and r.started_at > started + 6.0]
    assert slowdowns
    assert statistics.median(slowdowns) <= 2.0, slowdowns


async def test_two_workers_on_one_backend_converge_on_its_limit(
        tmp_path: Path, module_nats_url: str, module_redis_url: str,
        saturating: FakeBackend) -> None:
    """Each worker runs its own controller on the backend's shared latency:
    the sum settles where one worker alone would, not at twice it."""
    k, users = 8, 32
    pipeline = _pipeline(tmp_path, module_nats_url, module_redis_url, saturating, workers=2)
    try:
        started = time.monotonic()
        active, waiting, done = await _run(saturating, pipeline, users, seconds=12.0,
                                           settle=6.0)
        workers = await _registry(pipeline)
    finally:
        pipeline.stop()
    assert done > users, pipeline.logs()
    mean = statistics.mean(active)
    assert mean <= 1.5 * k, (mean, active)
    assert _slots_in_use(saturating, active, started + 6.0) >= k, (mean, active)
    assert statistics.median(waiting) >= (users - 1.5 * k) / 2, waiting
    assert len(workers) == 2, [(w.worker_id, w.pid, w.started, w.updated) for w in workers]
    assert all(w.models[MODEL].adaptive for w in workers)
    # Registry entries are up to a heartbeat old, so bound the sum loosely:
    # well below the 2 x 1024 that two uncoordinated ceilings would allow.
    assert sum(w.models[MODEL].slots for w in workers) <= 3 * k


async def test_each_replica_of_a_model_has_its_own_adaptive_limit(
        tmp_path: Path, module_nats_url: str, module_redis_url: str) -> None:
    """A model with two backend replicas and the default max_streams: the
    limit is each backend's, so each replica's slots grow past the starting
    min_streams (2) on their own, and the worker reports them as adaptive."""
    users = 24
    with threaded_fake_backend(models=[MODEL], ttft=TTFT, itl=ITL, tokens=TOKENS) as a, \
            threaded_fake_backend(models=[MODEL], ttft=TTFT, itl=ITL, tokens=TOKENS) as b:
        pipeline = Pipeline(tmp_path, module_nats_url, module_redis_url, overrides={
            "nats": {"subject_prefix": "a" + uuid.uuid4().hex[:8]},
            "models": [{"name": MODEL, "backend": "openai", "min_streams": 2,
                        "base_urls": [a.base_url, b.base_url]}]})
        pipeline.start()
        try:
            done = await _users(pipeline.url, users, time.monotonic() + 8.0)
            workers = await _registry(pipeline)
        finally:
            pipeline.stop()
    assert done > users, pipeline.logs()
    # Both replicas ran more streams at once than the floor: each grew.
    assert a.peak_active > 2, (a.peak_active, b.peak_active)
    assert b.peak_active > 2, (a.peak_active, b.peak_active)
    assert a.peak_active + b.peak_active >= users * 0.8
    (worker,) = workers
    assert worker.models[MODEL].adaptive
    assert set(worker.replicas[MODEL]) == {a.base_url.split("://")[1], b.base_url.split("://")[1]}
