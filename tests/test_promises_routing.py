"""What docs/routing.md promises and no other test proved, against real servers
(issue 26): a turn whose home replica is full runs on the other replica, not
behind the home's streams; and when a routed job and its fallback copy are
both live, exactly one of them runs. Which replica served a request is read
off the fake backends' own records. Each was seen failing with the promise
broken.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import nats
import pytest

from bench.fake_backend import FakeBackend
from bench.fake_records import FakeConfig
from tests.pipeline import DEV_KEY, Pipeline, threaded_fake_backend
from tests.poll import eventually
from tests.test_routing_pipeline import MODEL, converse, served_by
from tidegate.broker.kvwatch import snapshot
from tidegate.control.workers_registry import WorkerInfo

pytestmark = pytest.mark.pipeline

AUTH = {"Authorization": f"Bearer {DEV_KEY}"}
# A shared-queue pull request a worker had out when its slots filled may
# still deliver until it expires (docs/routing.md, "Bound on in-flight").
PULL_EXPIRY = 0.25


@pytest.fixture(scope="module")
def replicas() -> Iterator[tuple[FakeBackend, FakeBackend]]:
    with threaded_fake_backend(ttft=0.01, itl=0.001, tokens=4) as a, \
            threaded_fake_backend(ttft=0.01, itl=0.001, tokens=4) as b:
        yield a, b


def pipeline_of(tmp_path: Path, nats_url: str, redis_url: str,
                replicas: tuple[FakeBackend, FakeBackend], max_streams: int,
                worker: dict[str, Any] | None = None, session: dict[str, Any] | None = None,
                **routing: Any) -> Iterator[Pipeline]:
    models: list[dict[str, Any]] = [{
        "name": MODEL, "backend": "openai", "base_urls": [f.base_url for f in replicas],
        "max_streams": max_streams}]
    p = Pipeline(tmp_path, nats_url, redis_url, metrics=True, overrides={
        "nats": {"subject_prefix": "r" + uuid.uuid4().hex[:8]},
        "models": models, "routing": {"affinity": "auto", **routing},
        "worker": worker or {}, "session": session or {}})
    try:
        p.start()
        asyncio.run(replicas_reported(p, 2))
        yield p
    finally:
        p.stop()


async def replicas_reported(pipeline: Pipeline, count: int) -> None:
    """Until this pipeline's workers registry reports ``count`` replicas of
    MODEL: the dispatcher routes by what it reports."""
    nc = await nats.connect(pipeline.config.nats.url)
    try:
        kv = await nc.jetstream().key_value(pipeline.config.nats.subjects.workers_bucket)

        async def reported() -> bool:
            for value in (await snapshot(kv)).values():
                info = WorkerInfo.decode(value or b"{}")
                if len(info.replicas.get(MODEL, {})) == count:
                    return True
            return False

        await eventually(reported, 30, f"a worker reported {count} replicas of {MODEL}")
    finally:
        await nc.close()


def routes(pipeline: Pipeline, reason: str) -> float:
    """The dispatcher's count of jobs it routed for ``reason``."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in pipeline.scrape("dispatcher").splitlines()
               if line.startswith("tidegate_affinity_routes")
               and f'tidegate_route_reason="{reason}"' in line)


@pytest.fixture
def pipeline(tmp_path: Path, module_nats_url: str, module_redis_url: str,
             replicas: tuple[FakeBackend, FakeBackend]) -> Iterator[Pipeline]:
    # A routed job nobody claims gets its fallback copy only after 3 s
    # (routing.max_affinity_wait), so a turn that reached the other replica
    # through that fallback, not by the full-home rule, shows in the counts.
    yield from pipeline_of(tmp_path, module_nats_url, module_redis_url, replicas, 2,
                           max_affinity_wait=3.0)


async def test_a_full_home_sends_the_turn_to_the_other_replica(
        pipeline: Pipeline, replicas: tuple[FakeBackend, FakeBackend]) -> None:
    """Home at its limit (2 slots, both held by streams that outlast the
    test): the next turn of its conversation runs on the other replica, and
    before either of the home's streams ends."""
    key = f"busy-{uuid.uuid4().hex[:8]}"
    (home,) = await asyncio.to_thread(converse, pipeline, replicas,
                                      f"h-{uuid.uuid4().hex[:8]}", 1, prompt_cache_key=key)
    other = 1 - home
    async with home_filled(pipeline, replicas, key, home, fake_ttft=600.0) as held:
        fillers = list(held)
        # Both slots are taken, so the home pulls nothing more from the
        # shared queue; a pull it had out before runs out within its
        # expiry (a lower bound: more time only makes it surer).
        await asyncio.sleep(4 * PULL_EXPIRY)
        busy_before = routes(pipeline, "home_busy")
        turn = f"h2-{uuid.uuid4().hex[:8]}"
        where = await asyncio.to_thread(converse, pipeline, replicas, turn, 1,
                                        prompt_cache_key=key)
        assert where == [other], f"the turn ran on replica {where}, its home is {home}"
        # ... sent there at once by the full-home rule, not after the wait.
        assert routes(pipeline, "home_busy") == busy_before + 1
        # Not behind the home's streams: they are still running.
        assert all(r.finished_at is None and r.closed_at is None
                   for r in list(replicas[home].records)
                   if any(m in json.dumps(r.body) for m in fillers))


@contextlib.asynccontextmanager
async def home_filled(pipeline: Pipeline, replicas: tuple[FakeBackend, FakeBackend], key: str,
                      home: int,
                      fake_ttft: float) -> AsyncIterator[dict[str, asyncio.Task[Any]]]:
    """Two streams of conversation ``key`` (their first turns, nothing
    cached) holding both slots of its home replica, each ``fake_ttft`` s in
    its prefill; yields their client tasks by marker once both run there
    (cancelling one frees its slot), cancels them after."""
    fillers = [f"filler-{uuid.uuid4().hex}" for _ in range(2)]
    async with aiohttp.ClientSession() as session:
        held = [asyncio.create_task(session.post(
            f"{pipeline.base_url}/chat/completions", headers=AUTH, json={
                "model": MODEL, "max_tokens": 2, "prompt_cache_key": key,
                "fake_ttft": fake_ttft, "messages": [{"role": "user", "content": marker}]}))
            for marker in fillers]
        try:
            await eventually(lambda: all(served_by(replicas, m) == [home] for m in fillers), 60,
                             f"both fillers running on the home replica {home}")
            yield dict(zip(fillers, held, strict=True))
        finally:
            for task in held:
                task.cancel()
            await asyncio.gather(*held, return_exceptions=True)


@pytest.fixture
def caching() -> Iterator[tuple[FakeBackend, FakeBackend]]:
    """Replicas with the prefix-cache model: 1 ms of first token per prompt
    character their cache does not hold, 4 tokens 0.3 s apart."""
    config = FakeConfig(ttft=0.02, itl=0.3, tokens=4, prefill_per_char=1e-3)
    with threaded_fake_backend(config=config) as a, threaded_fake_backend(config=config) as b:
        yield a, b


@pytest.fixture
def waiting(tmp_path: Path, module_nats_url: str, module_redis_url: str,
            caching: tuple[FakeBackend, FakeBackend]) -> Iterator[Pipeline]:
    # A routed job unclaimed for 10 s gets its copy: far past the wait here.
    yield from pipeline_of(tmp_path, module_nats_url, module_redis_url, caching, 2,
                           max_affinity_wait=10.0)


async def test_a_full_home_is_waited_for_when_its_cache_saves_more(
        waiting: Pipeline, caching: tuple[FakeBackend, FakeBackend]) -> None:
    """The same full home as above, for a turn whose conversation holds
    2,000 characters there: about 2-3 s of prefill on the other replica,
    against a slot expected within about 0.7 s (a mean job, the pipeline's
    warm-up included, takes some 1.3 s, over two slots). The turn waits at
    its home (``home_wait``) and runs there once a filler's client leaves.
    The fillers outlast the test, so the only bound is the youngest running
    job's age against a mean job (1.3 s) when the turn is routed, not how
    soon a filler ends."""
    key = f"wait-{uuid.uuid4().hex[:8]}"
    system = f"You are {key}. " + "Keep the whole conversation in mind. " * 54
    history: list[dict[str, str]] = [{"role": "system", "content": system}]

    def turn(i: int) -> list[int]:
        history.append({"role": "user", "content": f"turn {i} of {key}"})
        body = {"model": MODEL, "messages": list(history), "max_tokens": 4,
                "prompt_cache_key": key}
        status, payload = waiting.post("/v1/chat/completions", body)
        assert status == 200, payload
        history.append({"role": "assistant", "content": f"answer {i}"})
        return served_by(caching, f"turn {i} of {key}")

    # Turn 0 prefills everything (the worker's cold sample), turn 1 finds it
    # cached at its home (its floor): the times a full home is judged by.
    (home,) = await asyncio.to_thread(turn, 0)
    assert await asyncio.to_thread(turn, 1) == [home]
    async with home_filled(waiting, caching, key, home, fake_ttft=600.0) as held:
        before = routes(waiting, "home_wait")
        ran = asyncio.create_task(asyncio.to_thread(turn, 2))
        await eventually(lambda: routes(waiting, "home_wait") == before + 1, 30,
                         "the turn routed to wait at its full home")
        next(iter(held.values())).cancel()  # its slot frees: the waiting turn takes it
        assert await ran == [home]


@pytest.fixture
def racing(tmp_path: Path, module_nats_url: str, module_redis_url: str,
           replicas: tuple[FakeBackend, FakeBackend]) -> Iterator[Pipeline]:
    # A fallback copy as soon as the dispatcher can check the claim. The
    # worker's ack_wait outlasts the test's pause of it, so no copy is
    # redelivered: every second run would be a failure of the claim.
    yield from pipeline_of(tmp_path, module_nats_url, module_redis_url, replicas, 16,
                           worker={"ack_wait": 20.0}, session={"worker_lost_after": 12},
                           max_affinity_wait=0.001)


def _count(path: Path, text: str) -> int:
    return path.read_text().count(text) if path.exists() else 0


async def test_two_live_copies_of_a_routed_job_run_exactly_once(
        racing: Pipeline, replicas: tuple[FakeBackend, FakeBackend]) -> None:
    """The race is forced, not hoped for: with the only worker stopped
    (SIGSTOP), nothing can claim a routed job, so the dispatcher copies every
    one to the shared queue; resumed, the worker holds both copies of each."""
    logs = racing.workdir / "logs"
    copied = _count(logs / "dispatcher.log", "copied to the shared queue")
    dropped = _count(logs / "worker0.log", "its other copy runs elsewhere")
    markers = [f"race-{uuid.uuid4().hex}" for _ in range(8)]
    worker = racing.workers[0].pid
    assert worker is not None
    async with aiohttp.ClientSession() as session:

        async def one(marker: str) -> int:
            async with session.post(f"{racing.base_url}/chat/completions", headers=AUTH, json={
                    "model": MODEL, "max_tokens": 2, "prompt_cache_key": marker,
                    "messages": [{"role": "user", "content": marker}]}) as resp:
                await resp.read()
                return resp.status

        os.kill(worker, signal.SIGSTOP)
        try:
            calls = [asyncio.create_task(one(m)) for m in markers]
            await eventually(lambda: _count(logs / "dispatcher.log", "copied to the shared queue")
                             >= copied + len(markers), 60,
                             "a fallback copy of every routed job")
        finally:
            os.kill(worker, signal.SIGCONT)
        statuses = await asyncio.gather(*calls)
    assert statuses == [200] * len(markers)
    # Every copy was taken off the work queue (run or dropped), so a second
    # run of any job would have reached a backend by now.
    nc = await nats.connect(racing.config.nats.url)
    try:
        js = nc.jetstream()
        stream = racing.config.nats.subjects.jobs_stream
        await eventually(lambda: _empty(js, stream), 60, "every job copy consumed")
    finally:
        await nc.close()
    for marker in markers:
        assert len(served_by(replicas, marker)) == 1, (marker, served_by(replicas, marker))
    # Each job's losing copy was dropped by the claim, not run.
    await eventually(lambda: _count(logs / "worker0.log", "its other copy runs elsewhere")
                     >= dropped + len(markers), 30,
                     "the worker dropped the losing copy of each raced job")


async def _empty(js: Any, stream: str) -> bool:
    return bool((await js.stream_info(stream)).state.messages == 0)
