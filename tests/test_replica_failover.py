"""A dead backend replica gets no new work (issue 25, item 2).

Unit: the breaker's transitions (sans-I/O). Pipeline: a model with two fake
replicas, one stopped (connection refused): every stream completes on the
other, the worker's breaker for the dead one opens and the workers registry
says so; once the replica answers again a half-open probe closes it. A model
with one replica only still answers its clean 502 ``backend_unavailable``.
A replica alive but failing (HTTP 500) gets no job but the breaker's probes
while its breaker is open, counted at the replica itself.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import nats
import pytest

from bench.fake_backend import FakeBackend
from fleet.run.servers import free_port
from tests.pipeline import DEV_KEY, Pipeline, threaded_fake_backend
from tests.poll import eventually
from tidegate.broker.kvwatch import snapshot
from tidegate.control.workers_registry import WorkerInfo
from tidegate.errors import BackendError
from workers.replicas import Breaker, BreakerState, ReplicaSet, replica_failure

T = TypeVar("T")
MODEL = "two-replicas"


# -- the breaker -------------------------------------------------------------------


def test_breaker_opens_after_consecutive_failures_and_probes_half_open() -> None:
    b = Breaker(failures=3, cooldown=1.0, max_cooldown=4.0)
    b.failure(0.0)
    b.failure(0.1)
    assert b.state is BreakerState.CLOSED
    assert b.allow(0.2)
    b.success()  # a success resets the count
    for t in (1.0, 1.1, 1.2):
        b.failure(t)
    assert b.state is BreakerState.OPEN
    assert not b.allow(2.1), "no work during the cooldown"
    assert b.allow(2.2), "the half-open probe"
    assert b.state is BreakerState.HALF_OPEN
    assert not b.allow(2.3), "one probe at a time"
    b.failure(2.4)  # the probe failed: open again, cooldown doubled
    assert b.state is BreakerState.OPEN
    assert b.wait == 2.0
    assert b.current(4.3) is BreakerState.OPEN
    assert b.current(4.4) is BreakerState.HALF_OPEN, "reported half-open: routing comes back"
    assert not b.allow(4.3)
    assert b.allow(4.4)
    b.failure(4.5)
    assert b.wait == 4.0
    assert b.allow(8.5)
    b.failure(8.6)
    assert b.wait == 4.0, "bounded by max_cooldown"
    assert b.allow(12.6)
    b.success()
    assert b.state is BreakerState.CLOSED
    assert b.allow(12.7)
    assert b.allow(12.7)


def test_a_job_routed_to_an_open_replica_goes_to_another_first() -> None:
    """The worker's side of "an open replica gets no job": a job routed to
    it (the registry said closed a moment ago) tries the others; the open
    one only as the half-open probe, or when none allows anything."""
    replicas = ReplicaSet()
    for name in ("a", "b"):
        replicas.add(name, None, Breaker(failures=1, cooldown=1.0))  # type: ignore[arg-type]
    replicas.breakers["a"].failure(0.0)
    assert [n for n, _ in replicas.candidates("a", 0.5)] == ["b"]
    replicas.breakers["b"].failure(0.5)
    assert [n for n, _ in replicas.candidates("a", 0.6)] == ["a"], "none allows: a's own error"
    assert [n for n, _ in replicas.candidates("b", 1.0)] == ["a"], "a's probe"
    assert [n for n, _ in replicas.candidates("a", 1.1)] == ["a"], "none allows: the first"


def test_only_the_replicas_own_failures_count() -> None:
    refused = BackendError(502, "unreachable", type="server_error", code="backend_unavailable")
    failed = BackendError(502, "HTTP 500", type="server_error", code="backend_error")
    bad = BackendError(400, "bad", type="invalid_request_error", code="invalid_request")
    limited = BackendError(429, "slow down", type="rate_limit_error",
                           code="backend_rate_limited")
    slow = BackendError(504, "no first byte", type="server_error", code="backend_timeout")
    assert replica_failure(refused)
    assert replica_failure(failed)
    assert not any(replica_failure(e) for e in (bad, limited, slow))


# -- the pipeline --------------------------------------------------------------------


class Replica:
    """A fake backend on a fixed port, on its own loop thread, that a test can
    stop (connection refused from then on) and start again."""

    def __init__(self) -> None:
        self.port = free_port()
        self.fake = FakeBackend(ttft=0.01, itl=0.002, tokens=12)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(15)

    def start(self) -> None:
        self._run(self.fake.start(port=self.port))

    def stop(self) -> None:
        self._run(self.fake.stop())

    def close(self) -> None:
        self.stop()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture
def replicas() -> Iterator[tuple[Replica, FakeBackend]]:
    a = Replica()
    a.start()
    with threaded_fake_backend(ttft=0.01, itl=0.002, tokens=12) as b:
        try:
            yield a, b
        finally:
            a.close()


@pytest.fixture
def pipeline(tmp_path: Path, nats_server: Any, redis_server: Any,
             replicas: tuple[Replica, FakeBackend]) -> Iterator[Pipeline]:
    a, b = replicas
    p = Pipeline(tmp_path, nats_server.url, redis_server.url, overrides={"models": [
        {"name": MODEL, "backend": "openai", "base_urls": [a.base_url, b.base_url],
         "max_streams": 64},
        {"name": "solo", "backend": "openai",
         "base_url": f"http://127.0.0.1:{free_port()}/v1", "max_streams": 4}]})
    try:
        p.start()
        yield p
    finally:
        p.stop()


async def chat(session: aiohttp.ClientSession, url: str, model: str, text: str
               ) -> tuple[int, list[str]]:
    async with session.post(f"{url}/v1/chat/completions", headers={
            "Authorization": f"Bearer {DEV_KEY}"}, json={
            "model": model, "stream": True, "max_tokens": 12,
            "messages": [{"role": "user", "content": text}]}) as resp:
        if resp.status != 200:
            return resp.status, [await resp.text()]
        return 200, [line[6:].decode().strip() async for line in resp.content
                     if line.startswith(b"data: ")]


async def breaker_of(pipeline: Pipeline, replica: str) -> str:
    nc = await nats.connect(pipeline.config.nats.url)
    try:
        kv = await nc.jetstream().key_value(pipeline.config.nats.subjects.workers_bucket)
        for value in (await snapshot(kv)).values():
            info = WorkerInfo.decode(value or b"{}")
            slot = info.replicas.get(MODEL, {}).get(replica)
            if slot is not None:
                return slot.breaker
    finally:
        await nc.close()
    return ""


@pytest.mark.slow
@pytest.mark.pipeline
async def test_a_dead_replica_costs_no_client_an_error_and_comes_back(
        pipeline: Pipeline, replicas: tuple[Replica, FakeBackend]) -> None:
    a, b = replicas
    name_a = a.base_url.split("://", 1)[1]
    a.stop()  # connection refused from now on
    async with aiohttp.ClientSession() as session:
        results = await asyncio.gather(*(chat(session, pipeline.url, MODEL,
                                              f"q-{i}-{uuid.uuid4().hex}") for i in range(30)))
        for status, events in results:
            assert status == 200, events
            assert events[-1] == "[DONE]", events[-2:]
        assert len(b.records) >= 30
        # The registry entry goes out on the breaker's change, but after it:
        # right after the streams end it may still say "closed".
        await eventually(lambda: _is(breaker_of(pipeline, name_a), "open", "half_open"), 30,
                         "the replica's breaker open in the registry")
        # With one replica there is nowhere to go: today's clean error.
        status, body = await chat(session, pipeline.url, "solo", "hello")
        assert status == 502, body
        assert "backend_unavailable" in body[0], body
        # The replica answers again: a half-open probe closes the breaker.
        before = len(a.fake.records)
        a.start()

        async def reaches_a() -> bool:
            # A new conversation each time: an old one keeps its home (b).
            status, events = await chat(session, pipeline.url, MODEL, uuid.uuid4().hex)
            assert status == 200, events
            assert events[-1] == "[DONE]", events
            return len(a.fake.records) > before

        await eventually(reaches_a, 60, "the recovered replica getting work again", step=0.2)
        await eventually(lambda: _is(breaker_of(pipeline, name_a), "closed"), 30,
                         "the breaker closed in the registry")


async def _is(value: Coroutine[Any, Any, str], *expected: str) -> bool:
    return await value in expected


def _transitions(pipeline: Pipeline, replica: str, change: str) -> int:
    return pipeline.log_text().count(f"replica {replica}: circuit breaker {change}")


@pytest.mark.slow
@pytest.mark.pipeline
async def test_a_replica_whose_breaker_is_open_gets_no_job_but_its_probes(
        pipeline: Pipeline, replicas: tuple[Replica, FakeBackend]) -> None:
    """Replica A alive but answering every job with HTTP 500 (what the
    connection-refused test above cannot count: a dead replica records
    nothing). Once its breaker opened, the jobs A receives, counted at A,
    are the breaker's half-open probes only, each one logged as it fails
    (``half_open -> open``): the dispatchers route nothing to an open
    replica and the worker sends it nothing but a probe. Every client gets
    its whole stream from B. A healed, a probe closes the breaker and A gets
    work again."""
    a, b = replicas
    name_a = a.base_url.split("://", 1)[1]
    a.fake.config.status = 500
    async with aiohttp.ClientSession() as session:

        async def opened() -> bool:
            status, events = await chat(session, pipeline.url, MODEL, uuid.uuid4().hex)
            assert status == 200, events
            assert events[-1] == "[DONE]", events[-2:]
            return _transitions(pipeline, name_a, "closed -> open") > 0

        await eventually(opened, 60, "replica A's breaker open", step=0.05)
        await eventually(lambda: _is(breaker_of(pipeline, name_a), "open", "half_open"), 30,
                         "the open breaker in the registry")
        before, on_b = len(a.fake.records), len(b.records)
        probes = _transitions(pipeline, name_a, "half_open -> open")
        results = await asyncio.gather(*(chat(session, pipeline.url, MODEL,
                                              f"open-{i}-{uuid.uuid4().hex}") for i in range(40)))
        for status, events in results:
            assert status == 200, events
            assert events[-1] == "[DONE]", events[-2:]
        # A probe's failure is logged before its job goes on to B, so before
        # its client's stream ends.
        sent = len(a.fake.records) - before
        probed = _transitions(pipeline, name_a, "half_open -> open") - probes
        print(f"while open: {sent} jobs reached replica A, {probed} of them probes")
        assert len(b.records) - on_b >= len(results)
        assert sent == probed, f"{sent} jobs reached the open replica, {probed} probes"
        # Healed: a probe (after at most max_cooldown) closes the breaker.
        a.fake.config.status = 0
        healed = len(a.fake.records)

        async def reaches_a() -> bool:
            status, events = await chat(session, pipeline.url, MODEL, uuid.uuid4().hex)
            assert status == 200, events
            assert events[-1] == "[DONE]", events
            return any(r.status == 200 for r in a.fake.records[healed:])

        await eventually(reaches_a, 90, "the healed replica getting work again", step=0.2)
        assert _transitions(pipeline, name_a, "half_open -> closed") == 1
        await eventually(lambda: _is(breaker_of(pipeline, name_a), "closed"), 30,
                         "the breaker closed in the registry")
