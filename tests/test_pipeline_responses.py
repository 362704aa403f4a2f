"""The Responses API and embeddings through edge -> JetStream -> dispatcher -> worker,
with the official openai SDK, against the simulator and the fake backend.

What "equal to the backend's" means here: for the simulator, the same request
run through ``SimulatorBackend`` in this process (ids and timestamps aside);
for the fake backend, the bytes it recorded writing (``keep_output``).
"""

from __future__ import annotations

import asyncio
import io
import json
import re
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
from tests.pipeline import (
    DEV_KEY,
    Pipeline,
    running_pipeline,
    threaded_fake_backend,
    wait_for,
)
from tidegate.apis import estimate_prompt_tokens
from tidegate.config import ModelConfig, SimulatorConfig
from tidegate.control.keys import create_key, ensure_keys_bucket
from tidegate.control.policies import Policy, ensure_policies_bucket, set_policy
from tidegate.wire.protocol import Api, Request
from workers.backends.simulator import SimulatorBackend
from workers.backends.simulator_responses import embed

pytestmark = pytest.mark.pipeline

SIM = SimulatorConfig(ttft=0.01, tokens_per_second=400.0, length=24)
EVENT_ORDER = ["response.created", "response.in_progress", "response.output_item.added",
               "response.content_part.added"]
CLOSING = ["response.output_text.done", "response.content_part.done",
           "response.output_item.done", "response.completed"]


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeBackend]:
    with threaded_fake_backend(models=["fake-model"], ttft=0.01, itl=0.002, tokens=12,
                               keep_output=True) as backend:
        yield backend


@pytest.fixture(scope="module")
def bare() -> Iterator[FakeBackend]:
    """A backend that serves chat only, as an older server does."""
    from bench.fake_backend import FakeConfig
    with threaded_fake_backend(config=FakeConfig(models=("fake-model",), ttft=0.01, itl=0.002,
                                          tokens=12, responses=False,
                                          embeddings=False)) as backend:
        yield backend


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory: pytest.TempPathFactory, module_nats_url: str,
             module_redis_url: str, fake: FakeBackend, bare: FakeBackend) -> Iterator[Pipeline]:
    workdir: Path = tmp_path_factory.mktemp("responses")
    models: list[dict[str, Any]] = [
        {"name": "tidegate-sim", "aliases": ["sim"],
         "simulator": {"ttft": SIM.ttft, "tokens_per_second": SIM.tokens_per_second,
                       "length": SIM.length}},
        {"name": "org/fake:v1", "backend": "openai", "base_url": fake.base_url,
         "upstream_model": "fake-model"},
        {"name": "old-server", "backend": "openai", "base_url": bare.base_url,
         "upstream_model": "fake-model"},
    ]
    yield from running_pipeline(workdir, module_nats_url, module_redis_url,
                                overrides={"models": models,
                                           "nats": {"subject_prefix": "r" + uuid.uuid4().hex[:6]}})


@pytest.fixture
async def client(pipeline: Pipeline) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url=pipeline.base_url, api_key=DEV_KEY,
                                  max_retries=0, timeout=30) as c:
        yield c


async def simulated(api: Api, body: dict[str, Any], stream: bool) -> tuple[bytes, Any]:
    """What the simulator itself answers to ``body`` (bytes, usage)."""
    backend = SimulatorBackend(ModelConfig(name="tidegate-sim", simulator=SIM))
    request = Request(id="x", reply="r", model="tidegate-sim", api=api, stream=stream,
                      body=body, created_ms=0, deadline_ms=0, window_bytes=1, window_msgs=1)
    s = await backend.open(request)
    out = b""
    while data := await s.read(1 << 20):
        out += data
    return out, s.usage


def _records(fake: FakeBackend, marker: str) -> list[Any]:
    return [r for r in list(fake.records) if marker in json.dumps(r.body.get("input"))]


# -- Responses, streaming ------------------------------------------------------------


async def test_responses_create_stream_against_simulator(client: openai.AsyncOpenAI) -> None:
    body = {"model": "tidegate-sim", "input": "Tell me about tides", "instructions": "Be brief"}
    stream = await client.responses.create(**body, stream=True)  # type: ignore[call-overload]
    events = [event async for event in stream]
    types = [e.type for e in events]
    assert types[:4] == EVENT_ORDER
    assert types[-4:] == CLOSING
    assert set(types[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    raw, usage = await simulated(Api.RESPONSES, {**body, "stream": True}, True)
    assert len(events) == raw.count(b"\n\n")
    final = events[-1].response
    assert final.usage is not None
    assert (final.usage.input_tokens, final.usage.output_tokens) == (
        usage.prompt_tokens, usage.completion_tokens)
    assert final.usage.output_tokens == SIM.length
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert final.output_text == text
    assert json.loads(raw.split(b"\n\n")[-2].split(b"data: ", 1)[1])["response"]["output"][0][
        "content"][0]["text"] == text


async def test_responses_stream_helper_against_simulator(client: openai.AsyncOpenAI) -> None:
    async with client.responses.stream(model="sim", input=[
            {"role": "user", "content": "Say something"}]) as stream:
        seqs = [event.sequence_number async for event in stream]
        final = await stream.get_final_response()
    assert seqs == list(range(len(seqs)))
    _, usage = await simulated(Api.RESPONSES, {
        "model": "sim", "input": [{"role": "user", "content": "Say something"}],
        "stream": True}, True)
    assert final.status == "completed"
    assert final.output_text
    assert len(final.output_text.split()) == SIM.length
    assert final.usage is not None
    assert final.usage.output_tokens == usage.completion_tokens
    assert final.usage.input_tokens == usage.prompt_tokens


async def test_responses_max_output_tokens_is_incomplete(client: openai.AsyncOpenAI) -> None:
    stream = await client.responses.create(model="sim", input="short", max_output_tokens=5,
                                           stream=True)
    events = [event async for event in stream]
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"
    assert sum(e.type == "response.output_text.delta" for e in events) == 5


async def test_responses_stream_relayed_byte_for_byte(pipeline: Pipeline,
                                                      fake: FakeBackend) -> None:
    marker = uuid.uuid4().hex
    body = {"model": "org/fake:v1", "input": f"bytes {marker}", "stream": True,
            "temperature": 0.5, "vendor_knob": {"x": [1, 2]}}
    raw = await _post_raw(pipeline, "/v1/responses", body)
    (record,) = _records(fake, marker)
    assert record.completed
    # Everything the backend wrote, and nothing else: no [DONE], no rewrite.
    assert _strip_pings(raw) == bytes(record.output)
    assert b"[DONE]" not in raw
    assert record.body == {**body, "model": "fake-model"}


async def test_missing_sequence_numbers_are_spliced_in(pipeline: Pipeline, fake: FakeBackend,
                                                       client: openai.AsyncOpenAI) -> None:
    marker = uuid.uuid4().hex
    body = {"model": "org/fake:v1", "input": f"noseq {marker}", "stream": True,
            "fake_no_seq": True}
    raw = _strip_pings(await _post_raw(pipeline, "/v1/responses", body))
    (record,) = _records(fake, marker)
    assert b"sequence_number" not in record.output
    events = raw.split(b"\n\n")[:-1]
    seqs = [int(m) for m in re.findall(rb'"sequence_number":(\d+)', raw)]
    assert seqs == list(range(len(events)))
    # Spliced, not re-encoded: removing the inserted member gives the backend's bytes.
    assert re.sub(rb'"sequence_number":\d+,', b"", raw) == bytes(record.output)
    # And the SDK's stream helper accepts it.
    async with client.responses.stream(model="org/fake:v1", input="noseq sdk",
                                       extra_body={"fake_no_seq": True}) as stream:
        sdk_seqs = [event.sequence_number async for event in stream]
        final = await stream.get_final_response()
    assert sdk_seqs == list(range(len(sdk_seqs)))
    assert final.usage is not None
    assert final.usage.output_tokens == 12


async def test_responses_usage_reaches_the_usage_log(pipeline: Pipeline, fake: FakeBackend,
                                                     module_nats_url: str) -> None:
    marker = uuid.uuid4().hex
    body = {"model": "org/fake:v1", "input": f"usage {marker} " + "word " * 40,
            "stream": True, "max_output_tokens": 7}
    async with aiohttp.ClientSession() as session, session.post(
            f"{pipeline.url}/v1/responses", json=body,
            headers={"Authorization": f"Bearer {DEV_KEY}"}) as resp:
        assert resp.status == 200
        request_id = resp.headers["x-request-id"]
        await resp.read()
    (record,) = _records(fake, marker)
    completed = json.loads(bytes(record.output).split(b"\n\n")[-2].split(b"data: ", 1)[1])
    expected = completed["response"]["usage"]
    usage = await _usage_record(pipeline, module_nats_url, request_id)
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (
        expected["input_tokens"], expected["output_tokens"]) == (expected["input_tokens"], 7)
    assert usage["outcome"] == "done"


# -- Responses, not streaming ------------------------------------------------------


async def test_responses_non_streaming_equals_backend(pipeline: Pipeline, fake: FakeBackend,
                                                      client: openai.AsyncOpenAI) -> None:
    marker = uuid.uuid4().hex
    body = {"model": "org/fake:v1", "input": f"json {marker}"}
    raw = await _post_raw(pipeline, "/v1/responses", body)
    (record,) = _records(fake, marker)
    assert raw == bytes(record.output)
    assert record.body == {**body, "model": "fake-model"}

    response = await client.responses.create(model="sim", input="Hello there")
    raw_sim, usage = await simulated(Api.RESPONSES, {"model": "sim", "input": "Hello there"},
                                     False)
    expected = json.loads(raw_sim)
    got = response.model_dump(mode="json", exclude_unset=True)
    for key in ("id", "created_at"):
        got.pop(key), expected.pop(key)
    got["output"][0].pop("id"), expected["output"][0].pop("id")
    assert got == expected
    assert response.usage is not None
    assert response.usage.output_tokens == usage.completion_tokens


# -- errors -----------------------------------------------------------------------------


async def test_backend_without_the_endpoint_gets_501(pipeline: Pipeline) -> None:
    for path, body in (("/v1/responses", {"model": "old-server", "input": "hi"}),
                       ("/v1/responses", {"model": "old-server", "input": "hi", "stream": True}),
                       ("/v1/embeddings", {"model": "old-server", "input": "hi"})):
        status, data = await asyncio.to_thread(pipeline.post, path, body)
        assert status == 501, (path, data)
        error = json.loads(data)["error"]
        assert error["code"] == "endpoint_not_supported"
        assert "'old-server'" in error["message"]
        assert path in error["message"]
    # The same backend's chat still works: the 501 is about the endpoint only.
    status, _ = await asyncio.to_thread(pipeline.post, "/v1/chat/completions", {
        "model": "old-server", "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]})
    assert status == 200


async def test_responses_validation_errors(pipeline: Pipeline) -> None:
    for body, param in (({"model": "sim"}, "input"),
                        ({"model": "sim", "input": 3}, "input"),
                        ({"model": "sim", "input": "x", "max_output_tokens": "9"},
                         "max_output_tokens"),
                        ({"model": "sim", "input": "x", "tools": {}}, "tools"),
                        ({"model": "sim", "input": "x", "background": "yes"}, "background")):
        status, data = await asyncio.to_thread(pipeline.post, "/v1/responses", body)
        assert status == 400, body
        assert json.loads(data)["error"]["param"] == param


# -- embeddings ---------------------------------------------------------------------


async def test_embeddings_single_and_batch(client: openai.AsyncOpenAI) -> None:
    one = await client.embeddings.create(model="sim", input="the tide turns")
    assert len(one.data) == 1
    assert one.data[0].embedding == embed("the tide turns", "tidegate-sim", 256)
    assert one.usage.prompt_tokens == estimate_prompt_tokens(
        Api.EMBEDDINGS, {"input": "the tide turns"})
    texts = ["alpha", "beta", "gamma"]
    batch = await client.embeddings.create(model="sim", input=texts, dimensions=16,
                                           encoding_format="float")
    assert [d.index for d in batch.data] == [0, 1, 2]
    assert [d.embedding for d in batch.data] == [embed(t, "tidegate-sim", 16) for t in texts]
    assert batch.usage.prompt_tokens == batch.usage.total_tokens > 0


async def test_embeddings_forwarded_as_sent(pipeline: Pipeline, fake: FakeBackend,
                                            client: openai.AsyncOpenAI) -> None:
    marker = uuid.uuid4().hex
    result = await client.embeddings.create(model="org/fake:v1", input=[marker, "two"],
                                            dimensions=12)
    (record,) = _records(fake, marker)
    # The SDK asks for base64 on its own; the body goes on exactly as sent.
    assert record.body == {"model": "fake-model", "input": [marker, "two"], "dimensions": 12,
                           "encoding_format": "base64"}
    assert [len(d.embedding) for d in result.data] == [12, 12]
    backend = json.loads(bytes(record.output))
    assert result.usage.prompt_tokens == backend["usage"]["prompt_tokens"]
    status, data = await asyncio.to_thread(pipeline.post, "/v1/embeddings", {
        "model": "sim", "input": "x", "stream": True})
    assert status == 400
    assert json.loads(data)["error"]["param"] == "stream"


async def test_embeddings_input_token_quota(pipeline: Pipeline, module_nats_url: str) -> None:
    """A tokens-per-minute policy charges embeddings' input: the estimate is
    reserved before (digits are costed high: 400 of them estimate to 360), and
    the backend's count (the fake: characters / 4 = 100) settles it after."""
    tenant = "emb" + uuid.uuid4().hex[:6]
    key = await _provision(pipeline, module_nats_url, tenant, Policy(tenant=tenant, tpm=500))
    body = {"model": "org/fake:v1", "input": "7" * 400}
    assert estimate_prompt_tokens(Api.EMBEDDINGS, body) == 360

    async def post() -> tuple[int, dict[str, Any]]:
        status, data = await asyncio.to_thread(pipeline.post, "/v1/embeddings", body, key=key)
        return status, json.loads(data)

    status, first = await post()
    assert status == 200
    assert first["usage"]["prompt_tokens"] == 100
    # Reserved 360 + 360 > 500 would refuse the second; once the first settled
    # at the backend's 100 tokens, 100 + 360 fits.
    deadline = time.monotonic() + 15
    while True:
        status, second = await post()
        if status == 200 or time.monotonic() > deadline:
            break
        assert status == 429
        assert second["error"]["type"] == "rate_limit_error"
        await asyncio.sleep(0.2)
    assert status == 200
    status, third = await post()
    assert status == 429, third
    assert third["error"]["code"] == "rate_limit_tokens"


# -- helpers ---------------------------------------------------------------------------


async def _post_raw(pipeline: Pipeline, path: str, body: dict[str, Any]) -> bytes:
    async with aiohttp.ClientSession() as session, session.post(
            f"{pipeline.url}{path}", json=body,
            headers={"Authorization": f"Bearer {DEV_KEY}"}) as resp:
        data = await resp.read()
        assert resp.status == 200, data
        return data


def _strip_pings(raw: bytes) -> bytes:
    return raw.replace(b": ping\n\n", b"")


async def _provision(pipeline: Pipeline, nats_url: str, tenant: str, policy: Policy) -> str:
    nc = await nats.connect(nats_url)
    try:
        js = nc.jetstream()
        key, _ = await create_key(await ensure_keys_bucket(js, pipeline.config), tenant)
        await set_policy(await ensure_policies_bucket(js, pipeline.config), policy)
    finally:
        await nc.close()
    # Edges and dispatchers follow KV within a second: poll until the key works.
    # Until the edge knows the key and the dispatcher the policy, which its
    # rate-limit header shows (each probe costs one token).
    deadline = time.monotonic() + 15
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            async with session.post(f"{pipeline.url}/v1/embeddings",
                                    json={"model": "org/fake:v1", "input": "x"},
                                    headers={"Authorization": f"Bearer {key}"}) as resp:
                await resp.read()
                if resp.headers.get("x-ratelimit-limit-tokens") == str(policy.tpm):
                    return key
            await asyncio.sleep(0.1)
    raise AssertionError("the key or policy did not reach the pipeline")


async def _usage_record(pipeline: Pipeline, nats_url: str, request_id: str) -> dict[str, Any]:
    """The request's record on the usage stream (polled: it is published async)."""
    import msgpack

    subjects = pipeline.config.nats.subjects
    nc = await nats.connect(nats_url)
    try:
        js = nc.jetstream()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            sub = await js.subscribe(subjects.usage_wildcard, ordered_consumer=True)
            try:
                while True:
                    try:
                        msg = await sub.next_msg(timeout=0.5)
                    except nats.errors.TimeoutError:
                        break
                    record = msgpack.unpackb(msg.data)
                    if record.get("id") == request_id:
                        return dict(record)
            finally:
                await sub.unsubscribe()
            await asyncio.sleep(0.2)
    finally:
        await nc.close()
    raise AssertionError(f"no usage record for {request_id}")


async def test_disconnect_mid_responses_stream_closes_the_backend(
        pipeline: Pipeline, fake: FakeBackend) -> None:
    """The Responses path cancels as chat does: the client goes, the backend
    connection closes (the fake would take a minute more to finish: closed
    well before that is the cancel's doing, whatever the machine's speed)."""
    marker = uuid.uuid4().hex
    body = {"model": "org/fake:v1", "input": f"cancel {marker}", "stream": True,
            "fake_itl": 5.0}
    async with aiohttp.ClientSession() as session:
        resp = await session.post(f"{pipeline.url}/v1/responses", json=body,
                                  headers={"Authorization": f"Bearer {DEV_KEY}"})
        seen = b""
        while seen.count(b"response.output_text.delta\n") < 1:
            seen += await resp.content.readany()
        resp.connection.transport.abort()  # type: ignore[union-attr]
        gone = time.monotonic()
        resp.close()
    assert await wait_for(lambda: bool(_records(fake, marker)
                                       and _records(fake, marker)[0].closed_at), 30.0)
    (record,) = _records(fake, marker)
    assert record.closed_at is not None, "the backend connection was not closed"
    assert not record.completed
    assert record.closed_at - gone < 30.0  # half the run the cancel saved


@pytest.mark.parametrize("endpoint", ["/v1/embeddings", "/v1/responses"])
async def test_batch_of_embeddings_and_responses(client: openai.AsyncOpenAI,
                                                 endpoint: str) -> None:
    """Both endpoints are batchable (``endpoint`` of the batch and ``url`` of
    each line); each result equals what the interactive endpoint answers."""
    texts = {f"line-{i}": f"batch input number {i}" for i in range(5)}
    lines = [{"custom_id": cid, "method": "POST", "url": endpoint,
              "body": {"model": "sim", "input": text}} for cid, text in texts.items()]
    data = b"".join(json.dumps(line).encode() + b"\n" for line in lines)
    file = await client.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch")
    batch = await client.batches.create(input_file_id=file.id, endpoint=endpoint,  # type: ignore[arg-type]
                                        completion_window="24h")
    deadline = time.monotonic() + 60
    while batch.status not in ("completed", "failed", "expired", "cancelled"):
        assert time.monotonic() < deadline, f"batch still {batch.status}"
        await asyncio.sleep(0.2)
        batch = await client.batches.retrieve(batch.id)
    assert batch.status == "completed", batch
    assert batch.request_counts is not None
    assert batch.request_counts.completed == len(texts)
    assert batch.output_file_id is not None
    content = await client.files.content(batch.output_file_id)
    results = {o["custom_id"]: o for o in map(json.loads, content.content.splitlines())}
    assert set(results) == set(texts)
    for cid, text in texts.items():
        body = results[cid]["response"]["body"]
        if endpoint == "/v1/embeddings":
            assert body["data"][0]["embedding"] == embed(text, "tidegate-sim", 256)
            assert body["usage"]["prompt_tokens"] == estimate_prompt_tokens(
                Api.EMBEDDINGS, {"input": text})
        else:
            interactive = await client.responses.create(model="sim", input=text)
            assert body["status"] == "completed"
            assert body["output"][0]["content"][0]["text"] == interactive.output_text
            assert body["usage"]["output_tokens"] == SIM.length
