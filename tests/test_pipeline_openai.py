"""The official openai SDK through edge -> JetStream -> dispatcher -> worker.

Against the simulator and against a fake OpenAI-compatible backend the test
runs itself; every request really crosses the broker, which the JetStream
sequence numbers in the response headers and the streams' own counters show.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import nats
import openai
import pytest

from tests.pipeline import DEV_KEY, Pipeline, running_pipeline, threaded_fake_backend

pytestmark = pytest.mark.pipeline


@pytest.fixture(scope="module")
def fake_backend_url() -> Iterator[str]:
    with threaded_fake_backend(models=["fake-model"], ttft=0.01, itl=0.002,
                               tokens=12) as backend:
        yield backend.base_url


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory: pytest.TempPathFactory, module_nats_url: str,
             module_redis_url: str, fake_backend_url: str) -> Iterator[Pipeline]:
    workdir: Path = tmp_path_factory.mktemp("pipeline")
    models: list[dict[str, Any]] = [
        {"name": "tidegate-sim", "aliases": ["sim"],
         "simulator": {"ttft": 0.01, "tokens_per_second": 400.0, "length": 32}},
        {"name": "org/fake-model:v1.5", "backend": "openai", "base_url": fake_backend_url,
         "upstream_model": "fake-model"},
    ]
    yield from running_pipeline(workdir, module_nats_url, module_redis_url,
                                overrides={"models": models})


@pytest.fixture
async def client(pipeline: Pipeline) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url=pipeline.base_url, api_key=DEV_KEY,
                                  max_retries=0, timeout=30) as c:
        yield c


@pytest.mark.parametrize("model", ["tidegate-sim", "org/fake-model:v1.5"])
async def test_streaming_chat(client: openai.AsyncOpenAI, model: str) -> None:
    stream = await client.chat.completions.create(
        model=model, stream=True, max_tokens=8,
        messages=[{"role": "user", "content": "Tell me a story"}],
        stream_options={"include_usage": True})
    content, finish, usage, chunks = "", None, None, 0
    async for chunk in stream:
        chunks += 1
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            content += choice.delta.content or ""
            finish = choice.finish_reason or finish
    assert chunks >= 3
    assert content.strip(), "no content streamed"
    assert finish == "length"
    assert usage is not None
    assert usage.completion_tokens == 8
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


@pytest.mark.parametrize("model", ["sim", "org/fake-model:v1.5"])
async def test_non_streaming_chat(client: openai.AsyncOpenAI, model: str) -> None:
    response = await client.chat.completions.create(
        model=model, max_tokens=5, messages=[{"role": "user", "content": "Hello"}])
    assert response.choices[0].message.role == "assistant"
    assert response.choices[0].message.content
    assert response.usage is not None
    assert response.usage.completion_tokens == 5
    assert response.choices[0].finish_reason == "length"


async def test_streaming_without_include_usage_has_no_usage_chunk(
        client: openai.AsyncOpenAI) -> None:
    stream = await client.chat.completions.create(
        model="org/fake-model:v1.5", stream=True, max_tokens=4,
        messages=[{"role": "user", "content": "x"}])
    chunks = [chunk async for chunk in stream]
    # The worker asks the backend for usage (for accounting) but must strip
    # that chunk when the client did not ask for it.
    assert all(chunk.choices for chunk in chunks)
    assert all(chunk.usage is None for chunk in chunks)


@pytest.mark.parametrize("model", ["tidegate-sim", "org/fake-model:v1.5"])
async def test_legacy_completions(client: openai.AsyncOpenAI, model: str) -> None:
    text = ""
    stream = await client.completions.create(model=model, prompt="Once upon", max_tokens=6,
                                             stream=True)
    async for chunk in stream:
        text += "".join(c.text for c in chunk.choices)
    assert text.strip()
    response = await client.completions.create(model=model, prompt="Once upon", max_tokens=6)
    assert response.choices[0].text.strip()
    assert response.usage is not None
    assert response.usage.completion_tokens == 6


async def test_models_list(client: openai.AsyncOpenAI) -> None:
    ids = {m.id async for m in client.models.list()}
    assert {"tidegate-sim", "sim", "org/fake-model:v1.5"} <= ids


async def test_requests_cross_jetstream(pipeline: Pipeline, client: openai.AsyncOpenAI,
                                        module_nats_url: str) -> None:
    subjects = pipeline.config.nats.subjects
    nc = await nats.connect(module_nats_url)
    try:
        js = nc.jetstream()
        before_req = (await js.stream_info(subjects.requests_stream)).state.last_seq
        before_job = (await js.stream_info(subjects.jobs_stream)).state.last_seq
        raw = await client.chat.completions.with_raw_response.create(
            model="sim", max_tokens=3, messages=[{"role": "user", "content": "seq"}])
        request_seq = int(raw.headers["x-tidegate-request-seq"])
        job_seq = int(raw.headers["x-tidegate-job-seq"])
        after_req = (await js.stream_info(subjects.requests_stream)).state.last_seq
        after_job = (await js.stream_info(subjects.jobs_stream)).state.last_seq
    finally:
        await nc.close()
    assert before_req < request_seq <= after_req
    assert before_job < job_seq <= after_job
    assert raw.headers["x-request-id"]
    body = json.loads(raw.content)
    assert body["id"].endswith(raw.headers["x-request-id"])


async def test_upstream_error_before_first_byte_is_http_status(
        client: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        await client.chat.completions.create(
            model="org/fake-model:v1.5", max_tokens=3, stream=True,
            messages=[{"role": "user", "content": "x"}],
            extra_body={"fake_status": 400})
    assert bad.value.status_code == 400
    with pytest.raises(openai.APIStatusError) as upstream_5xx:
        await client.chat.completions.create(
            model="org/fake-model:v1.5", max_tokens=3,
            messages=[{"role": "user", "content": "x"}],
            extra_body={"fake_status": 500})
    assert upstream_5xx.value.status_code == 502
    assert "backend" in str(upstream_5xx.value).lower()


async def test_upstream_failure_mid_stream_is_final_error_event(
        client: openai.AsyncOpenAI, pipeline: Pipeline) -> None:
    stream = await client.chat.completions.create(
        model="org/fake-model:v1.5", max_tokens=10, stream=True,
        messages=[{"role": "user", "content": "x"}], extra_body={"fake_fail_after": 3})
    received: list[str] = []

    async def consume() -> None:
        async for chunk in stream:
            received.extend(c.delta.content or "" for c in chunk.choices)

    with pytest.raises(openai.APIError) as failed:
        await consume()
    assert "".join(received), "chunks before the failure must reach the client"
    assert "backend" in str(failed.value).lower()
    # The same failure on the wire: the stream ends with the error event (no
    # `data: [DONE]`, so no client takes the answer as complete), whose
    # retryable flag says a retry would not help (a backend that broke the
    # stream is a backend_error, workers/backends/upstream.py).
    async with aiohttp.ClientSession() as session, session.post(
            f"{pipeline.base_url}/chat/completions",
            json={"model": "org/fake-model:v1.5", "max_tokens": 10, "stream": True,
                  "messages": [{"role": "user", "content": "x"}], "fake_fail_after": 3},
            headers={"Authorization": f"Bearer {DEV_KEY}"}) as resp:
        assert resp.status == 200
        events = [line[6:].strip() for line in (await resp.read()).split(b"\n")
                  if line.startswith(b"data: ")]
    assert b"[DONE]" not in events
    assert len(events) >= 2, events
    error = json.loads(events[-1])["error"]
    assert error["code"] == "backend_error", error
    assert error["type"] == "server_error"
    assert error.get("retryable", False) is False, error
    assert all("error" not in json.loads(e) for e in events[:-1])
