"""A hostile tenant's batches against the real pipeline (issue 24, items 1, 3, 7).

Real nats-server and redis-server, edge / dispatcher / worker processes:

* a line whose body the wire cannot carry (``max_tokens`` 2^64) is an error
  of that line, and the stack keeps serving (it once crashed the dispatcher,
  and ``tidegate up`` crash-looped);
* a key's model list, revocation and expiry hold for its batch lines as for
  its interactive requests, at validation and at release;
* ``POST /v1/batches`` parses JSON the bounded way every route does, batch
  lines refuse duplicate keys, and every hostile body the chat route rejects
  is rejected as a batch line too.
"""

from __future__ import annotations

import asyncio
import io
import json
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import nats
import openai
import pytest

from tests.pipeline import DEV_KEY, Pipeline, running_pipeline
from tests.test_fuzz_edge import NASTY_BODIES
from tidegate.broker import objects
from tidegate.control.batches import open_stores
from tidegate.control.keys import (
    KEY_ID_LENGTH,
    create_key,
    ensure_keys_bucket,
    key_digest,
    revoke_key,
)
from tidegate.wire.batch import BatchStatus

pytestmark = pytest.mark.pipeline

CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory: pytest.TempPathFactory, module_nats_url: str,
             module_redis_url: str) -> Iterator[Pipeline]:
    models: list[dict[str, Any]] = [
        {"name": "tidegate-sim", "aliases": ["sim"],
         "simulator": {"ttft": 0.01, "tokens_per_second": 400.0, "length": 32}},
        {"name": "other-model", "simulator": {"ttft": 0.01, "tokens_per_second": 400.0,
                                              "length": 8}},
        # Two slots, a second a line: a batch still has lines waiting when
        # the test revokes its key.
        {"name": "slow-sim", "max_streams": 2,
         "simulator": {"ttft": 0.05, "tokens_per_second": 20.0, "length": 20}},
    ]
    yield from running_pipeline(
        tmp_path_factory.mktemp("batchhostile"), module_nats_url, module_redis_url,
        overrides={"models": models, "batch": {"max_file_bytes": 8 << 20, "lease": 1.0}})


def _client(pipeline: Pipeline, key: str = DEV_KEY) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=pipeline.base_url, api_key=key, max_retries=0,
                              timeout=30)


@pytest.fixture
async def client(pipeline: Pipeline) -> AsyncIterator[openai.AsyncOpenAI]:
    async with _client(pipeline) as c:
        yield c


def line(custom_id: str, model: str = "tidegate-sim", **body: Any) -> bytes:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": CHAT,
                       "body": {"model": model, "max_tokens": 4,
                                "messages": [{"role": "user", "content": custom_id}],
                                **body}}).encode() + b"\n"


async def submit(client: openai.AsyncOpenAI, data: bytes) -> Any:
    file = await client.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch")
    return await client.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions",
                                       completion_window="24h")


async def ended(client: openai.AsyncOpenAI, batch_id: str, within: float = 90.0) -> Any:
    deadline = time.monotonic() + within
    while True:
        batch = await client.batches.retrieve(batch_id)
        if batch.status in ("completed", "failed", "expired", "cancelled"):
            return batch
        assert time.monotonic() < deadline, f"batch {batch_id} still {batch.status}"
        await asyncio.sleep(0.2)


async def lines_of(client: openai.AsyncOpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    content = await client.files.content(file_id)
    return [json.loads(x) for x in content.content.splitlines() if x.strip()]


def serves(pipeline: Pipeline, key: str = DEV_KEY) -> None:
    status, body = pipeline.post(CHAT, {"model": "tidegate-sim", "max_tokens": 3,
                                        "messages": [{"role": "user", "content": "hi"}]},
                                 key=key)
    assert status == 200, body[:300]
    for process in pipeline.processes:
        assert process.running, process.describe_failure(process.name)


async def new_key(pipeline: Pipeline, models: tuple[str, ...] = ()) -> str:
    nc = await nats.connect(pipeline.config.nats.url)
    try:
        key, _ = await create_key(await ensure_keys_bucket(nc.jetstream(), pipeline.config),
                                  "hostile", models=models)
    finally:
        await nc.close()
    async with _client(pipeline, key) as c:  # the key reaches the edge through its watch
        deadline = time.monotonic() + 15
        while True:
            try:
                await c.files.list()
                return key
            except openai.AuthenticationError:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.1)


# -- item 1: a line the wire cannot carry ------------------------------------------


async def test_a_max_tokens_of_2_64_is_a_line_error_and_the_stack_keeps_serving(
        pipeline: Pipeline, client: openai.AsyncOpenAI) -> None:
    data = line("ok-1") + line("huge", max_tokens=2**64) + line("ok-2")
    batch = await ended(client, (await submit(client, data)).id)
    assert batch.status == "failed", batch
    errors = [(e.code, e.line) for e in batch.errors.data or []]
    assert errors == [("invalid_value", 2)]
    # The dispatcher is still the one that started: it did not crash, and it
    # runs the next batch and interactive traffic.
    serves(pipeline)
    follow = await ended(client, (await submit(client, line("after-1") + line("after-2"))).id)
    assert follow.status == "completed", follow
    assert follow.request_counts.completed == 2
    assert pipeline.dispatcher.running
    assert "Traceback" not in pipeline.dispatcher.log_tail(400)


# -- item 3: the key's rules ---------------------------------------------------------


async def test_a_model_restricted_key_cannot_run_other_models_in_a_batch(
        pipeline: Pipeline) -> None:
    key = await new_key(pipeline, models=("other-model",))
    status, body = pipeline.post(CHAT, {"model": "tidegate-sim", "max_tokens": 2,
                                        "messages": [{"role": "user", "content": "x"}]},
                                 key=key)
    # A model the key may not use reads as one that does not exist (no name leaks).
    assert status == 404
    assert b"model_not_found" in body
    async with _client(pipeline, key) as restricted:
        data = line("mine", model="other-model") + line("theirs") + line("alias", model="sim")
        batch = await ended(restricted, (await submit(restricted, data)).id)
        assert batch.status == "failed", batch
        assert [(e.code, e.line) for e in batch.errors.data or []] == [
            ("model_not_allowed", 2), ("model_not_allowed", 3)]
        allowed = await ended(restricted,
                              (await submit(restricted, line("m1", model="other-model"))).id)
        assert allowed.status == "completed", allowed


async def test_revoking_the_key_ends_the_unreleased_lines_with_revoked_api_key(
        pipeline: Pipeline) -> None:
    key = await new_key(pipeline)
    total = 10
    async with _client(pipeline, key) as c:
        data = b"".join(line(f"r-{i}", model="slow-sim") for i in range(total))
        batch = await submit(c, data)
        deadline = time.monotonic() + 60
        while True:  # some lines done, most still waiting for one of two slots
            current = await c.batches.retrieve(batch.id)
            if current.request_counts and current.request_counts.completed >= 1:
                break
            assert time.monotonic() < deadline, current
            await asyncio.sleep(0.1)
    nc = await nats.connect(pipeline.config.nats.url)
    try:
        kv = await ensure_keys_bucket(nc.jetstream(), pipeline.config)
        assert await revoke_key(kv, key_digest(key)[:KEY_ID_LENGTH])
        # The key is gone, so its tenant cannot read the batch any more: the
        # operator's view (the stores, as `tidegate batches show` reads them).
        stores = await open_stores(nc.jetstream(), pipeline.config)
        deadline = time.monotonic() + 90
        while True:
            done = await stores.get_batch(None, batch.id)
            assert done is not None
            if done.terminal and done.files_written:
                break
            assert time.monotonic() < deadline, done
            await asyncio.sleep(0.2)
        assert done.status is BatchStatus.COMPLETED, done
        outputs: list[dict[str, Any]] = []
        for file_id, count in ((done.output_file_id, done.counts.completed),
                               (done.error_file_id, done.counts.failed)):
            if count:
                data = b"".join([chunk async for chunk in objects.read(
                    stores.js, stores.files_bucket, file_id)])
                outputs += [json.loads(x) for x in data.splitlines() if x.strip()]
    finally:
        await nc.close()
    ids = [o["custom_id"] for o in outputs]
    assert sorted(ids) == sorted(f"r-{i}" for i in range(total))  # each exactly once
    revoked = [o for o in outputs if o["response"]["status_code"] == 401]
    assert revoked, outputs
    assert all(o["response"]["body"]["error"]["code"] == "revoked_api_key" for o in revoked)
    finished = [o for o in outputs if o["response"]["status_code"] == 200]
    assert finished, "lines released before the revoke finish"
    serves(pipeline)


# -- item 7: JSON parsing and the hostile corpus -------------------------------------


async def test_deeply_nested_batch_create_body_is_a_400(pipeline: Pipeline) -> None:
    for raw in (b"[" * 50_000, b'{"input_file_id":' + b"[" * 50_000,
                b'{"endpoint":"/v1/chat/completions","endpoint":"/v1/completions"}'):
        status, body = pipeline.post("/v1/batches", None, raw=raw)
        assert status == 400, (status, body[:300])
        assert json.loads(body)["error"]["code"] == "invalid_json"
    serves(pipeline)


async def test_duplicate_keys_in_a_line_or_its_body_are_line_errors(
        client: openai.AsyncOpenAI) -> None:
    data = (line("a")
            + b'{"custom_id":"b","custom_id":"c","method":"POST","url":"' + CHAT.encode()
            + b'","body":{"model":"tidegate-sim","messages":[{"role":"user","content":"x"}]}}\n'
            + b'{"custom_id":"d","method":"POST","url":"' + CHAT.encode()
            + b'","body":{"model":"tidegate-sim","model":"other-model",'
              b'"messages":[{"role":"user","content":"x"}]}}\n'
            # Nested objects keep their last value, as in a normal request.
            + b'{"custom_id":"e","method":"POST","url":"' + CHAT.encode()
            + b'","body":{"model":"tidegate-sim","max_tokens":2,"metadata":{"k":"1","k":"2"},'
              b'"messages":[{"role":"user","content":"x"}]}}\n')
    batch = await ended(client, (await submit(client, data)).id)
    assert batch.status == "failed", batch
    assert [(e.code, e.line) for e in batch.errors.data or []] == [
        ("invalid_json_line", 2), ("invalid_json_line", 3)]


def _as_line(i: int, body: bytes) -> bytes:
    """A batch line carrying ``body`` byte for byte as its request body."""
    return (b'{"custom_id":"h-%d","method":"POST","url":"' % i + CHAT.encode()
            + b'","body":' + body + b"}\n")


async def test_every_hostile_chat_body_is_rejected_as_a_batch_line(
        pipeline: Pipeline, client: openai.AsyncOpenAI) -> None:
    """One batch holding the whole corpus (docs/security.md, "Fuzz corpus"):
    every line is named in the errors, none runs, the stack keeps serving.
    The same corpus, one parametrized case per body, runs without servers in
    tests/test_batch_model.py::test_hostile_chat_bodies_fail_as_batch_lines."""
    data = b"".join(_as_line(i, body) for i, body in enumerate(NASTY_BODIES))
    batch = await ended(client, (await submit(client, data)).id)
    assert batch.status == "failed", batch
    named = {e.line for e in batch.errors.data or []}
    assert named == set(range(1, len(NASTY_BODIES) + 1)), sorted(
        set(range(1, len(NASTY_BODIES) + 1)) - named)
    serves(pipeline)
