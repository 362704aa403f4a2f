"""What README.md and docs/ promise about failures, against real servers.

Each test here is one documented promise that no other test checked (issue
19): the deadlines at the edge (``dispatcher_unavailable``,
``no_worker_available``, ``request_timeout``, ``response_too_large``), load
shedding (503 ``overloaded``), the usage records, deduplication of a request
dispatched twice, and readiness. Each was tried against code with the
behaviour removed (see the commit that added it).

Every test runs its own tiers under its own subject prefix on the module's
nats-server and redis-server, so streams and buckets never leak between tests.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import nats
import pytest

from bench.fake_backend import FakeBackend
from dispatcher.quota import QuotaStore
from dispatcher.quota import connect as connect_quota_store
from tests.pipeline import (
    DEV_KEY,
    Pipeline,
    record_for,
    threaded_fake_backend,
    usage_of,
    usage_records,
    wait_log,
)
from tests.poll import eventually
from tidegate.control.keys import create_key, ensure_keys_bucket
from tidegate.control.policies import Policy, ensure_policies_bucket, set_policy
from tidegate.wire.protocol import Api, Request, decode_session

pytestmark = pytest.mark.pipeline

AUTH = {"Authorization": f"Bearer {DEV_KEY}"}


@pytest.fixture(scope="module")
def backend() -> Iterator[FakeBackend]:
    # No natural end: max_tokens decides every length.
    with threaded_fake_backend(models=["fake"], ttft=0.01, itl=0.005, tokens=10**9) as fake:
        yield fake


def make(tmp_path: Path, nats_url: str, redis_url: str, backend: FakeBackend,
         workers: int = 1, **sections: dict[str, Any]) -> Pipeline:
    """A pipeline (not started) serving ``fake`` from the fake backend and a
    slow simulator model ``slow-sim`` (5 tokens/s)."""
    overrides: dict[str, Any] = {
        "nats": {"subject_prefix": "p" + uuid.uuid4().hex[:8]},
        "session": {"heartbeat_interval": 1.0, "worker_lost_after": 5},
        "models": [
            {"name": "fake", "backend": "openai", "base_url": backend.base_url,
             "max_streams": 64},
            {"name": "slow-sim", "simulator": {"ttft": 0.0, "tokens_per_second": 5.0,
                                               "length": 1000}},
        ],
    }
    for section, values in sections.items():
        overrides.setdefault(section, {}).update(values)
    return Pipeline(tmp_path, nats_url, redis_url, overrides=overrides, workers=workers)


@pytest.fixture
def pipelines(tmp_path: Path, module_nats_url: str, module_redis_url: str,
              backend: FakeBackend) -> Iterator[Any]:
    made: list[Pipeline] = []

    def build(workers: int = 1, **sections: dict[str, Any]) -> Pipeline:
        p = make(tmp_path / f"p{len(made)}", module_nats_url, module_redis_url, backend,
                 workers, **sections)
        made.append(p)
        return p

    yield build
    for p in made:
        p.stop()


def chat(marker: str, **extra: Any) -> dict[str, Any]:
    return {"model": "fake", "messages": [{"role": "user", "content": marker}], **extra}


def error_of(body: bytes) -> dict[str, Any]:
    error = json.loads(body)["error"]
    assert set(error) >= {"message", "type", "param", "code"}, error
    return dict(error)


async def read_events(resp: aiohttp.ClientResponse) -> list[str]:
    return [line[6:].decode().strip() async for line in resp.content
            if line.startswith(b"data: ")]


async def stream_state(pipeline: Pipeline, stream: str) -> Any:
    nc = await nats.connect(pipeline.config.nats.url)
    try:
        return (await nc.jetstream().stream_info(stream)).state
    finally:
        await nc.close()


# ---------------------------------------------------------------------------
# 3. Deadlines before the first byte
# ---------------------------------------------------------------------------


async def test_no_dispatcher_within_admission_timeout_is_503_dispatcher_unavailable(
        pipelines: Any) -> None:
    pipeline = pipelines(edge={"admission_timeout": 1.5}, dispatcher={"ack_wait": 1.0})
    await asyncio.to_thread(pipeline.edge.start)  # no dispatcher at all
    started = time.monotonic()
    status, headers, body = await asyncio.to_thread(
        pipeline.post_full, "/v1/chat/completions", chat("nobody", max_tokens=2))
    took = time.monotonic() - started
    assert status == 503, body
    error = error_of(body)
    assert error["code"] == "dispatcher_unavailable"
    assert headers["Retry-After"] == "5"
    assert 1.5 <= took < 15, f"answered after {took:.1f}s"


async def test_no_worker_within_queue_timeout_then_the_expired_job_is_dropped(
        pipelines: Any, backend: FakeBackend) -> None:
    """Admitted, but no worker starts it within edge.queue_timeout: 503
    no_worker_available. A worker that starts later drops the job at pull
    (its deadline passed) with a zero-token usage record, never calling the
    backend."""
    pipeline = pipelines(edge={"queue_timeout": 2.0})
    pipeline.dispatcher.spawn()
    await asyncio.to_thread(pipeline.edge.start)  # no worker yet
    marker = f"late-{uuid.uuid4().hex}"
    status, headers, body = await asyncio.to_thread(
        pipeline.post_full, "/v1/chat/completions", chat(marker, max_tokens=2))
    assert status == 503, body
    error = error_of(body)
    assert error["code"] == "no_worker_available"
    assert "fake" in error["message"]
    assert headers["Retry-After"] == "5"
    jobs = pipeline.config.nats.subjects.jobs_stream
    assert (await stream_state(pipeline, jobs)).messages == 1, "the job waits in TG_JOBS"

    pipeline.workers[0].spawn()
    [record] = await eventually(usage_records_now(pipeline), 30.0,
                                "the worker's record of the expired job")
    assert record.outcome == "dropped", record
    assert (record.prompt_tokens, record.completion_tokens) == (0, 0)
    await eventually(lambda: stream_empty(pipeline, jobs), 10.0, "the expired job acked")
    assert not record_for(backend, marker), "an expired job reached the backend"


async def test_job_whose_deadline_passed_in_the_queue_is_dropped_at_pull(
        pipelines: Any, backend: FakeBackend) -> None:
    """No edge involved (so no cancel tombstone either): a job admitted with a
    deadline that passes before any worker pulls it is dropped at pull."""
    pipeline = pipelines()
    pipeline.dispatcher.spawn()
    await wait_log(pipeline.dispatcher, "dispatcher pulling")  # the streams exist
    marker = f"expired-{uuid.uuid4().hex}"
    request = direct_request(pipeline, marker, deadline_in=2.0)
    subjects = pipeline.config.nats.subjects
    nc = await nats.connect(pipeline.config.nats.url)
    try:
        await nc.jetstream().publish(subjects.request(request.klass, request.tenant),
                                     request.encode(), headers={"Nats-Msg-Id": request.id})
    finally:
        await nc.close()

    async def admitted() -> bool:
        return int((await stream_state(pipeline, subjects.jobs_stream)).messages) == 1
    await eventually(admitted, 15.0, "the job is admitted into TG_JOBS")
    await eventually(lambda: time.time() * 1000 > request.deadline_ms + 100, 5.0,
                     "the deadline passes")
    pipeline.workers[0].spawn()
    [record] = await usage_of(pipeline.config, request.id, within=30)
    assert record.outcome == "dropped", record
    await eventually(lambda: stream_empty(pipeline, subjects.jobs_stream), 10.0,
                     "the expired job acked")
    assert not record_for(backend, marker), "an expired job reached the backend"


def direct_request(pipeline: Pipeline, marker: str, deadline_in: float = 60.0) -> Request:
    """A request as an edge would publish it, answered on a test inbox."""
    request_id = uuid.uuid4().hex[:24]
    now_ms = int(time.time() * 1000)
    # Only an edge inbox may be a reply subject (the dispatcher drops others).
    reply = pipeline.config.nats.subjects.out("testedge", request_id)
    return Request(id=request_id, reply=reply, edge="testedge",
                   model="fake", api=Api.CHAT, stream=True,
                   body=chat(marker, max_tokens=3, stream=True), created_ms=now_ms,
                   deadline_ms=now_ms + int(deadline_in * 1000), window_bytes=1 << 20,
                   window_msgs=1024)


def usage_records_now(pipeline: Pipeline) -> Any:
    async def probe() -> list[Any]:
        return await usage_records(pipeline.config)
    return probe


async def stream_empty(pipeline: Pipeline, stream: str) -> bool:
    return int((await stream_state(pipeline, stream)).messages) == 0


# ---------------------------------------------------------------------------
# 4. Load shedding at the front door
# ---------------------------------------------------------------------------


async def test_full_requests_stream_is_503_overloaded_with_retry_after(pipelines: Any) -> None:
    pipeline = pipelines(streams={"requests_max_msgs": 2},
                         edge={"admission_timeout": 30.0})
    await asyncio.to_thread(pipeline.edge.start)  # no dispatcher: requests stay queued
    requests = pipeline.config.nats.subjects.requests_stream
    async with aiohttp.ClientSession() as session:
        waiting = [asyncio.create_task(session.post(
            f"{pipeline.url}/v1/chat/completions", json=chat(f"w{i}", max_tokens=1),
            headers=AUTH)) for i in range(2)]
        try:
            async def full() -> bool:
                return int((await stream_state(pipeline, requests)).messages) == 2
            await eventually(full, 15.0, "two requests wait in TG_REQUESTS")
            async with session.post(f"{pipeline.url}/v1/chat/completions",
                                    json=chat("third", max_tokens=1), headers=AUTH) as resp:
                status, headers, body = resp.status, resp.headers, await resp.read()
        finally:
            for task in waiting:
                task.cancel()
            await asyncio.gather(*waiting, return_exceptions=True)
    assert status == 503, body
    error = error_of(body)
    assert error["code"] == "overloaded"
    assert headers["Retry-After"] == "2"
    assert headers["Content-Type"].startswith("application/json")


# ---------------------------------------------------------------------------
# 9. Limits on one response
# ---------------------------------------------------------------------------


async def test_response_too_large_and_request_timeout(pipelines: Any) -> None:
    """edge.max_response_bytes caps a non-streaming body (502
    response_too_large); edge.request_timeout caps any response (504
    request_timeout, or the final SSE event once streaming)."""
    pipeline = pipelines(edge={"max_response_bytes": 4096, "request_timeout": 2.0})
    await asyncio.to_thread(pipeline.start)
    status, _, body = await asyncio.to_thread(
        pipeline.post_full, "/v1/chat/completions", chat("big", max_tokens=5000, fake_itl=0.0))
    assert status == 502, body[:300]
    assert error_of(body)["code"] == "response_too_large"
    # A streaming response has no such cap: the same request streams.
    status, _, body = await asyncio.to_thread(
        pipeline.post_full, "/v1/chat/completions",
        chat("big", max_tokens=1000, stream=True, fake_itl=0.0))
    assert status == 200
    assert len(body) > 4096
    assert body.endswith(b"data: [DONE]\n\n")

    slow = {"model": "slow-sim", "max_tokens": 100,
            "messages": [{"role": "user", "content": "slow"}]}
    started = time.monotonic()
    status, _, body = await asyncio.to_thread(pipeline.post_full, "/v1/chat/completions", slow)
    took = time.monotonic() - started
    assert status == 504, body
    error = error_of(body)
    assert error["code"] == "request_timeout"
    assert 2.0 <= took < 15, f"answered after {took:.1f}s"
    async with aiohttp.ClientSession() as session, session.post(
            f"{pipeline.url}/v1/chat/completions", json={**slow, "stream": True},
            headers=AUTH) as resp:
        assert resp.status == 200
        events = await read_events(resp)
    assert "[DONE]" not in events
    assert json.loads(events[-1])["error"]["code"] == "request_timeout"
    assert len(events) > 2, "output streamed before the deadline"


# ---------------------------------------------------------------------------
# 6. Usage records
# ---------------------------------------------------------------------------


async def test_usage_records_of_completed_and_cancelled_requests(
        pipelines: Any, module_nats_url: str, module_redis_url: str) -> None:
    """One TG_USAGE record per request: tokens, TTFT, duration and outcome for
    a completed one; the partial usage of a cancelled one, which the
    dispatcher reconciles the tokens-per-minute reservation down to."""
    pipeline = pipelines()
    nc = await nats.connect(module_nats_url)
    try:
        js = nc.jetstream()
        key, record = await create_key(await ensure_keys_bucket(js, pipeline.config), "bill",
                                       user="ann")
        key_id = record.key_id
        policy = Policy(tenant="bill", tpm=1_000_000)
        await set_policy(await ensure_policies_bucket(js, pipeline.config), policy)
    finally:
        await nc.close()
    await asyncio.to_thread(pipeline.start)
    headers = {"Authorization": f"Bearer {key}"}
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{pipeline.url}/v1/chat/completions",
                                json=chat("bill me", max_tokens=12), headers=headers) as resp:
            assert resp.status == 200
            done_id = resp.headers["x-request-id"]
            answer = await resp.json()
        resp = await session.post(f"{pipeline.url}/v1/chat/completions",
                                  json=chat("cut me", max_tokens=100_000, stream=True),
                                  headers=headers)
        assert resp.status == 200
        cut_id = resp.headers["x-request-id"]
        seen = 0
        async for line in resp.content:
            seen += line.startswith(b"data: ")
            if seen >= 5:
                break
        resp.close()  # the client goes away mid-stream

    [done] = await usage_of(pipeline.config, done_id)
    assert done.outcome == "done"
    assert (done.tenant, done.user, done.key_id, done.model) == ("bill", "ann", key_id, "fake")
    assert done.completion_tokens == 12 == answer["usage"]["completion_tokens"]
    assert done.prompt_tokens == answer["usage"]["prompt_tokens"] > 0
    assert done.finish_reason == "length"
    assert 0 < done.ttft_ms <= done.duration_ms
    assert done.attempt == 1
    assert done.reserved

    [cut] = await usage_of(pipeline.config, cut_id)
    assert cut.outcome == "cancelled"
    assert 4 <= cut.completion_tokens < 100_000, cut
    assert cut.prompt_tokens > 0
    # Reconciled: the tenant's window holds what both requests used, not the
    # 100,000-token reservation of the cancelled one.
    used = done.prompt_tokens + done.completion_tokens + cut.prompt_tokens + cut.completion_tokens
    client = connect_quota_store(module_redis_url, 2.0)
    store = QuotaStore(client, prefix=pipeline.config.nats.subject_prefix)
    try:
        async def window_total() -> bool:
            _, _, total_key, _ = store.scope_keys(policy.scope_id)
            return int(await client.get(total_key) or 0) == used
        await eventually(window_total, 15.0, f"the tenant's window reconciled to {used}")
    finally:
        await client.aclose()


# ---------------------------------------------------------------------------
# 7. Deduplication
# ---------------------------------------------------------------------------


async def test_a_request_dispatched_twice_runs_once(pipelines: Any,
                                                    backend: FakeBackend) -> None:
    """Two deliveries of one request (as after a dispatcher died between
    publishing the job and acking the request) become one job: the job's
    Nats-Msg-Id is the request id, so JetStream keeps only the first."""
    pipeline = pipelines()
    pipeline.dispatcher.spawn()
    pipeline.workers[0].spawn()
    await wait_log(pipeline.workers[0], "worker serving fake")
    subjects = pipeline.config.nats.subjects
    marker = f"twice-{uuid.uuid4().hex}"
    request = direct_request(pipeline, marker)
    inbox = request.reply
    nc = await nats.connect(pipeline.config.nats.url)
    try:
        kinds: list[str] = []

        async def note(msg: Any) -> None:
            kinds.append(type(decode_session(msg.data)).__name__)

        sub = await nc.subscribe(inbox, cb=note)
        js = nc.jetstream()
        subject = subjects.request(request.klass, request.tenant)
        # Two distinct messages in TG_REQUESTS (their own ids differ), one request.
        for copy in ("a", "b"):
            await js.publish(subject, request.encode(), headers={"Nats-Msg-Id": f"{copy}-x"})
        await eventually(lambda: kinds.count("Status") == 2, 15.0,
                         "both copies dispatched (two admissions)")
        await eventually(lambda: "Done" in kinds, 15.0, "the job done")
        await eventually(lambda: stream_empty(pipeline, subjects.requests_stream), 10.0,
                         "both copies acked (each after its job publish)")
        await sub.unsubscribe()
        jobs = await js.stream_info(subjects.jobs_stream)
    finally:
        await nc.close()
    assert jobs.state.last_seq == 1, "the second publish of the job was not deduplicated"
    assert len(record_for(backend, marker)) == 1, "the request ran twice"
    assert kinds.count("Done") == 1

