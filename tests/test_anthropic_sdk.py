"""The ``anthropic`` Python SDK (pinned in pyproject.toml's dev extra),
unchanged, pointed at a real pipeline with ``base_url``: a message, a stream,
a tool call, count_tokens, and Message Batches end to end (create, retrieve
until ended, list, results, cancel). A test here fails when the SDK and
tidegate stop understanding each other.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import anthropic
import openai
import pytest
from anthropic.types.messages import MessageBatch

from bench.fake_backend import FakeBackend, FakeConfig
from tests.pipeline import DEV_KEY, Pipeline, running_pipeline, threaded_fake_backend

pytestmark = pytest.mark.pipeline

HELLO = [{"role": "user", "content": "Tell me about tides"}]
WEATHER = {"name": "get_weather", "description": "The weather in a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                            "required": ["city"]}}


@pytest.fixture(scope="module")
def tools_backend() -> Iterator[FakeBackend]:
    """A chat backend that answers a request listing tools with a call."""
    with threaded_fake_backend(config=FakeConfig(models=("fake-model",), ttft=0.01, itl=0.002,
                                                 tokens=8, messages=False,
                                                 tool_calls=True)) as backend:
        yield backend


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory: pytest.TempPathFactory, module_nats_url: str,
             module_redis_url: str, tools_backend: FakeBackend) -> Iterator[Pipeline]:
    models: list[dict[str, Any]] = [
        {"name": "tidegate-sim", "simulator": {"ttft": 0.01, "tokens_per_second": 400.0,
                                               "length": 24}},
        # Two slots and ~1 s a request: a batch of 12 is still running when it is canceled.
        {"name": "slow-sim", "max_streams": 2,
         "simulator": {"ttft": 0.05, "tokens_per_second": 20.0, "length": 20}},
        {"name": "tools", "backend": "openai", "base_url": tools_backend.base_url,
         "upstream_model": "fake-model"},
    ]
    yield from running_pipeline(
        tmp_path_factory.mktemp("anthropic_sdk"), module_nats_url, module_redis_url,
        overrides={"models": models, "batch": {"lease": 1.0},
                   "nats": {"subject_prefix": "a" + uuid.uuid4().hex[:6]}})


@pytest.fixture
async def client(pipeline: Pipeline) -> AsyncIterator[anthropic.AsyncAnthropic]:
    async with anthropic.AsyncAnthropic(base_url=pipeline.url, api_key=DEV_KEY,
                                        max_retries=0, timeout=30) as c:
        yield c


async def test_create(client: anthropic.AsyncAnthropic) -> None:
    message = await client.messages.create(model="tidegate-sim", max_tokens=16,
                                           messages=HELLO)  # type: ignore[arg-type]
    assert message.type == "message"
    assert message.role == "assistant"
    assert message.model == "tidegate-sim"
    assert message.content[0].type == "text"
    assert message.content[0].text
    assert message.stop_reason in ("end_turn", "max_tokens")
    assert message.usage.input_tokens > 0
    assert message.usage.output_tokens > 0


async def test_stream(client: anthropic.AsyncAnthropic) -> None:
    async with client.messages.stream(model="tidegate-sim", max_tokens=16,
                                      messages=HELLO) as stream:  # type: ignore[arg-type]
        pieces = [text async for text in stream.text_stream]
        final = await stream.get_final_message()
    assert len(pieces) > 1
    assert final.content[0].type == "text"
    assert final.content[0].text == "".join(pieces)
    assert final.usage.output_tokens > 0


async def test_tools(client: anthropic.AsyncAnthropic) -> None:
    message = await client.messages.create(
        model="tools", max_tokens=64, tools=[WEATHER],  # type: ignore[list-item]
        messages=[{"role": "user", "content": "Weather in Paris?"}])
    assert message.stop_reason == "tool_use"
    calls = [b for b in message.content if b.type == "tool_use"]
    assert calls
    assert calls[0].name == "get_weather"
    assert isinstance(calls[0].input, dict)
    # ... and the round trip: the tool's result goes back, an answer comes.
    answer = await client.messages.create(
        model="tools", max_tokens=16, messages=[
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": message.content},  # type: ignore[typeddict-item]
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": calls[0].id,
                                          "content": "Sunny, 21 C"}]}])
    assert answer.content
    assert answer.stop_reason in ("end_turn", "max_tokens")


async def test_count_tokens(client: anthropic.AsyncAnthropic) -> None:
    short = await client.messages.count_tokens(model="tidegate-sim",
                                               messages=HELLO)  # type: ignore[arg-type]
    long = await client.messages.count_tokens(
        model="tidegate-sim", system="You are terse.",
        messages=[{"role": "user", "content": "Tell me about tides " * 50}])
    assert 0 < short.input_tokens < long.input_tokens


def request(custom_id: str, text: str, model: str = "tidegate-sim",
            max_tokens: int = 12) -> dict[str, Any]:
    return {"custom_id": custom_id,
            "params": {"model": model, "max_tokens": max_tokens,
                       "messages": [{"role": "user", "content": text}]}}


async def until_ended(client: anthropic.AsyncAnthropic, batch_id: str,
                      within: float = 120.0) -> MessageBatch:
    deadline = time.monotonic() + within
    while (batch := await client.messages.batches.retrieve(batch_id)).processing_status \
            != "ended":
        assert time.monotonic() < deadline, batch
        await asyncio.sleep(0.2)
    return batch


async def test_message_batches_end_to_end(client: anthropic.AsyncAnthropic) -> None:
    requests = [request(f"q-{i}", f"Question {i} about tides") for i in range(5)]
    created = await client.messages.batches.create(requests=requests)  # type: ignore[arg-type]
    assert created.type == "message_batch"
    assert created.id.startswith("msgbatch_")
    assert created.processing_status == "in_progress"
    assert created.request_counts.processing == 5
    assert created.results_url is None
    assert created.expires_at.timestamp() - created.created_at.timestamp() == 86400

    batch = await until_ended(client, created.id)
    counts = batch.request_counts
    assert (counts.succeeded, counts.errored, counts.canceled, counts.expired,
            counts.processing) == (5, 0, 0, 0, 0)
    assert batch.ended_at is not None
    assert batch.ended_at >= batch.created_at
    assert batch.results_url
    assert batch.results_url.endswith(f"/{batch.id}/results")
    assert batch.cancel_initiated_at is None

    listed = [b.id async for b in client.messages.batches.list(limit=1)]
    assert batch.id in listed  # one per page: the SDK follows last_id

    results = {r.custom_id: r.result async for r in
               await client.messages.batches.results(batch.id)}
    assert sorted(results) == sorted(r["custom_id"] for r in requests)
    for item in requests:
        result = results[item["custom_id"]]
        assert result.type == "succeeded", result
        # The same request, sent interactively, gets the same answer.
        alone = await client.messages.create(**item["params"])
        assert result.message.content == alone.content
        assert result.message.usage.output_tokens == alone.usage.output_tokens
        assert result.message.model == "tidegate-sim"
    # A batch that ended without a cancel cannot be canceled.
    with pytest.raises(anthropic.ConflictError):
        await client.messages.batches.cancel(batch.id)


async def test_cancel_a_message_batch(client: anthropic.AsyncAnthropic,
                                      pipeline: Pipeline) -> None:
    requests = [request(f"c-{i}", f"slow {i}", model="slow-sim", max_tokens=20)
                for i in range(12)]
    batch = await client.messages.batches.create(requests=requests)  # type: ignore[arg-type]
    # Anthropic's counts say nothing until the end; the same batch seen
    # through the OpenAI Batches API shows when the first request finished.
    async with openai.AsyncOpenAI(base_url=pipeline.base_url, api_key=DEV_KEY,
                                  max_retries=0, timeout=30) as peek:
        same = "batch_" + batch.id.removeprefix("msgbatch_")
        deadline = time.monotonic() + 60
        while ((seen := await peek.batches.retrieve(same)).request_counts is None
               or seen.request_counts.completed < 1):
            assert time.monotonic() < deadline, seen
            await asyncio.sleep(0.1)
        assert seen.endpoint == "/v1/messages"
    canceled = await client.messages.batches.cancel(batch.id)
    assert canceled.processing_status in ("canceling", "ended")
    assert canceled.cancel_initiated_at is not None
    ended = await until_ended(client, batch.id)
    counts = ended.request_counts
    assert counts.succeeded >= 1
    assert counts.canceled >= 1
    assert counts.processing == 0
    assert counts.succeeded + counts.errored + counts.canceled + counts.expired == 12
    results = [r async for r in await client.messages.batches.results(batch.id)]
    assert sorted(r.custom_id for r in results) == sorted(r["custom_id"] for r in requests)
    kinds = [r.result.type for r in results]
    assert kinds.count("canceled") == counts.canceled
    assert kinds.count("succeeded") == counts.succeeded
    # Canceling it again is the same cancel.
    again = await client.messages.batches.cancel(batch.id)
    assert again.processing_status == "ended"
    assert again.request_counts == counts
