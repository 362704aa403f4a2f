"""The Responses API's background mode, served from tidegate's stream log, with
the official openai SDK: create and drop, retrieve until completed, resume
with ``starting_after`` on a second edge, cancel, tenant isolation.

Real nats-server and redis-server, two edges, a dispatcher and a worker as
processes; the simulator and the fake backend (which has no background mode
of its own: tidegate serves it).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import nats
import openai
import pytest

from bench.fake_backend import FakeBackend
from tests.pipeline import DEV_KEY, Pipeline, running_pipeline, threaded_fake_backend, wait_for
from tidegate.control.keys import create_key, ensure_keys_bucket

pytestmark = pytest.mark.pipeline

LENGTH = 24


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeBackend]:
    with threaded_fake_backend(models=["fake-model"], ttft=0.01, itl=0.002, tokens=12,
                               keep_output=True) as backend:
        yield backend


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory: pytest.TempPathFactory, module_nats_url: str,
             module_redis_url: str, fake: FakeBackend) -> Iterator[Pipeline]:
    workdir: Path = tmp_path_factory.mktemp("background")
    models: list[dict[str, Any]] = [
        {"name": "tidegate-sim", "aliases": ["sim"],
         "simulator": {"ttft": 0.01, "tokens_per_second": 200.0, "length": LENGTH}},
        # Slow: still running when a test drops, resumes or cancels it.
        {"name": "slow-sim", "simulator": {"ttft": 0.05, "tokens_per_second": 20.0,
                                           "length": LENGTH}},
        {"name": "org/fake:v1", "backend": "openai", "base_url": fake.base_url,
         "upstream_model": "fake-model"},
    ]
    yield from running_pipeline(workdir, module_nats_url, module_redis_url, edges=2,
                                overrides={"models": models, "resume": {"attach_interval": 0.5},
                                           "nats": {"subject_prefix": "b" + uuid.uuid4().hex[:6]}})


@pytest.fixture
async def clients(pipeline: Pipeline) -> AsyncIterator[list[openai.AsyncOpenAI]]:
    out = [openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=DEV_KEY, max_retries=0,
                              timeout=30) for url in pipeline.edge_urls]
    try:
        yield out
    finally:
        for c in out:
            await c.close()


async def _until_done(client: openai.AsyncOpenAI, rid: str, within: float = 30.0) -> Any:
    deadline = time.monotonic() + within
    while True:
        response = await client.responses.retrieve(rid)
        if response.status not in ("queued", "in_progress"):
            return response
        assert time.monotonic() < deadline, f"{rid} still {response.status}"
        await asyncio.sleep(0.1)


async def test_background_create_then_retrieve_on_any_edge(
        clients: list[openai.AsyncOpenAI]) -> None:
    a, b = clients
    created = await a.responses.create(model="sim", input="background tides",
                                       background=True)
    assert created.status in ("queued", "in_progress")
    assert created.background is True
    assert created.id.startswith("resp_")
    assert len(created.id) == len("resp_") + 24
    done = await _until_done(b, created.id)  # the other edge serves it from the log
    assert done.status == "completed"
    assert done.id == created.id
    foreground = await a.responses.create(model="sim", input="background tides")
    assert done.output_text == foreground.output_text
    assert done.usage is not None
    assert foreground.usage is not None
    assert done.usage.output_tokens == foreground.usage.output_tokens == LENGTH


async def test_a_background_create_sent_again_under_its_key_is_the_same_response(
        clients: list[openai.AsyncOpenAI]) -> None:
    """Idempotency-Key (docs/resume.md): the second create, on the other edge,
    answers the first one's response object; nothing runs twice."""
    a, b = clients
    key = {"Idempotency-Key": f"bg-{time.monotonic_ns()}"}
    created = await a.responses.create(model="sim", input="background keyed",
                                       background=True, extra_headers=key)
    done = await _until_done(a, created.id)
    raw = await b.responses.with_raw_response.create(model="sim", input="background keyed",
                                                     background=True, extra_headers=key)
    again = raw.parse()
    assert raw.headers["Idempotent-Replayed"] == "true"
    assert again.id == created.id
    assert again.status == "completed"
    assert again.output_text == done.output_text
    other = await b.responses.create(model="sim", input="background keyed", background=True)
    assert other.id != created.id  # no key: a new response


async def test_background_against_a_backend_without_background_mode(
        clients: list[openai.AsyncOpenAI], fake: FakeBackend) -> None:
    marker = uuid.uuid4().hex
    created = await clients[0].responses.create(model="org/fake:v1", input=f"bg {marker}",
                                                background=True)
    done = await _until_done(clients[1], created.id)
    assert done.status == "completed"
    assert done.usage is not None
    assert done.usage.output_tokens == 12
    (record,) = [r for r in list(fake.records) if marker in json.dumps(r.body.get("input"))]
    assert "background" not in record.body  # the backend answered in the foreground


async def test_stream_dropped_then_resumed_on_a_second_edge(
        pipeline: Pipeline, clients: list[openai.AsyncOpenAI]) -> None:
    """Every event once: what the first connection got, then from
    ``starting_after`` on edge B, ends with response.completed."""
    a, b = clients
    first: list[Any] = []
    stream = await a.responses.create(model="slow-sim", input="resume me", background=True,
                                      stream=True)
    async for event in stream:
        first.append(event)
        if len(first) == 6:
            break
    await stream.close()  # the connection drops mid-generation
    rid = first[0].response.id
    assert rid.startswith("resp_")
    last = first[-1].sequence_number
    rest = [e async for e in await b.responses.retrieve(rid, stream=True,
                                                       starting_after=last)]
    events = first + rest
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].type == "response.completed"
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == events[-1].response.output_text
    assert len(text.split()) == LENGTH
    done = await b.responses.retrieve(rid)
    assert done.status == "completed"
    assert done.output_text == text


async def test_cancel_closes_the_backend_connection(
        clients: list[openai.AsyncOpenAI], fake: FakeBackend) -> None:
    marker = uuid.uuid4().hex
    a, b = clients
    created = await a.responses.create(model="org/fake:v1", input=f"cancel {marker}",
                                       background=True, extra_body={"fake_itl": 0.3})

    def record() -> Any:
        found = [r for r in list(fake.records) if marker in json.dumps(r.body.get("input"))]
        return found[0] if found else None

    # The backend has it (and, non-streaming, takes 3.3 s over its answer).
    assert await wait_for(lambda: record() is not None, 15.0)
    cancelled = await b.responses.cancel(created.id)  # on the edge that did not create it
    assert cancelled.status == "cancelled"
    assert await wait_for(lambda: record().closed_at is not None, 5.0), \
        "the backend connection was not closed"
    assert not record().completed
    again = await a.responses.cancel(created.id)  # idempotent
    assert again.status == "cancelled"
    assert (await _until_done(a, created.id)).status == "cancelled"


async def test_other_tenant_gets_404(pipeline: Pipeline, module_nats_url: str,
                                     clients: list[openai.AsyncOpenAI]) -> None:
    created = await clients[0].responses.create(model="sim", input="mine", background=True)
    nc = await nats.connect(module_nats_url)
    try:
        key, _ = await create_key(await ensure_keys_bucket(nc.jetstream(), pipeline.config),
                                  "intruder")
    finally:
        await nc.close()
    headers = {"Authorization": f"Bearer {key}"}
    async with aiohttp.ClientSession() as session:
        assert await wait_for_key(session, pipeline, headers)
        for method, path in (("GET", f"/v1/responses/{created.id}"),
                             ("GET", f"/v1/responses/{created.id}?stream=true"),
                             ("POST", f"/v1/responses/{created.id}/cancel"),
                             ("GET", "/v1/responses/resp_" + "0" * 24),
                             ("GET", "/v1/responses/not-an-id")):
            async with session.request(method, f"{pipeline.url}{path}",
                                       headers=headers) as resp:
                body = await resp.json()
                assert resp.status == 404, (path, body)
                assert body["error"]["code"] == "response_not_found"
    # Still there for its owner.
    assert (await _until_done(clients[0], created.id)).status == "completed"


async def wait_for_key(session: aiohttp.ClientSession, pipeline: Pipeline,
                       headers: dict[str, str]) -> bool:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        async with session.get(f"{pipeline.url}/v1/models", headers=headers) as resp:
            if resp.status == 200:
                return True
        await asyncio.sleep(0.1)
    return False


async def test_a_background_response_whose_worker_dies_before_output_runs_again(
        tmp_path: Path, module_nats_url: str, module_redis_url: str) -> None:
    """Worker 0 SIGKILLed during the prefill of a background response (no
    edge follows it): JetStream redelivers the job after ``worker.ack_wait``,
    and worker 1, finding no output in the log, runs it again instead of
    waiting for an edge's go-ahead that never comes: the response completes,
    whole. Seen failing (``failed`` with ``worker_lost`` after the silence
    limit) with the redelivered job dropped for want of an edge."""
    import os
    import signal

    models = [{"name": "sim", "simulator": {"ttft": 3.0, "tokens_per_second": 200.0,
                                            "length": LENGTH}}]
    pipeline = Pipeline(tmp_path, module_nats_url, module_redis_url, workers=2, overrides={
        "nats": {"subject_prefix": "g" + uuid.uuid4().hex[:6]}, "models": models,
        "session": {"heartbeat_interval": 1.0, "worker_lost_after": 40},
        "worker": {"ack_wait": 4.0}})
    pipeline.start()
    other = pipeline.workers[1].pid
    assert other is not None
    try:
        async with openai.AsyncOpenAI(base_url=pipeline.base_url, api_key=DEV_KEY,
                                      max_retries=0, timeout=30) as client:
            os.kill(other, signal.SIGSTOP)  # the job starts on worker 0
            try:
                await asyncio.sleep(3.0)  # worker 1's pull requests expire
                created = await client.responses.create(model="sim", input="bg death",
                                                        background=True)
                await asyncio.sleep(1.0)  # in worker 0's prefill
            finally:
                os.kill(other, signal.SIGCONT)
            pipeline.workers[0].kill()
            done = await _until_done(client, created.id, within=60)
            foreground = await client.responses.create(model="sim", input="bg death")
    finally:
        pipeline.stop()
    assert done.status == "completed", done
    assert done.output_text == foreground.output_text
    assert done.usage is not None
    assert done.usage.output_tokens == LENGTH
