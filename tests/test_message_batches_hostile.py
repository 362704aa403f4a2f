"""Anthropic Message Batches against a hostile client and another tenant,
on the real pipeline (edge, dispatcher, worker, nats-server, redis-server):

* every malformed create (custom_id, duplicates, too many, too large, bad
  params, the edge's nasty bodies as params) is a 4xx in Anthropic's shape
  naming the request, never a 500, and leaves nothing stored;
* another tenant's key gets 404 for the batch, its cancel and its results,
  and does not see it listed; ids that are not ours are 404 too;
* the storage quota counts a batch's requests as an upload;
* a batch whose window ends mid-run ends with ``expired`` results.
"""

from __future__ import annotations

import asyncio
import io
import json
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import anthropic
import nats
import openai
import pytest

from tests.pipeline import DEV_KEY, Pipeline, running_pipeline
from tests.test_fuzz_edge import NASTY_BODIES
from tidegate.control.keys import create_key, ensure_keys_bucket

pytestmark = pytest.mark.pipeline

MAX_BODY = 256 << 10
MAX_LINE = 16 << 10
MAX_LINES = 20
QUOTA = 64 << 10
PATH = "/v1/messages/batches"
USER = [{"role": "user", "content": "hi"}]


def _models() -> list[dict[str, Any]]:
    return [
        {"name": "tidegate-sim", "simulator": {"ttft": 0.01, "tokens_per_second": 400.0,
                                               "length": 8}},
        # Two slots, ~1 s a request: a batch of 8 runs for seconds.
        {"name": "slow-sim", "max_streams": 2,
         "simulator": {"ttft": 0.05, "tokens_per_second": 20.0, "length": 20}}]


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory: pytest.TempPathFactory, module_nats_url: str,
             module_redis_url: str) -> Iterator[Pipeline]:
    yield from running_pipeline(
        tmp_path_factory.mktemp("msgbatch_hostile"), module_nats_url, module_redis_url,
        overrides={"models": _models(), "edge": {"max_body_bytes": MAX_BODY},
                   "batch": {"lease": 1.0, "max_lines": MAX_LINES, "max_line_bytes": MAX_LINE,
                             "tenant_storage_bytes": QUOTA},
                   "nats": {"subject_prefix": "h" + uuid.uuid4().hex[:6]}})


async def key_of(pipeline: Pipeline, tenant: str) -> str:
    nc = await nats.connect(pipeline.config.nats.url)
    try:
        key, _ = await create_key(await ensure_keys_bucket(nc.jetstream(), pipeline.config),
                                  tenant)
    finally:
        await nc.close()
    deadline = time.monotonic() + 20
    while call(pipeline, "GET", PATH, key=key)[0] == 401:  # reaches the edge by a KV watch
        assert time.monotonic() < deadline
        await asyncio.sleep(0.1)
    return key


def call(pipeline: Pipeline, method: str, path: str, body: bytes | None = None,
         key: str = DEV_KEY) -> tuple[int, Any]:
    req = urllib.request.Request(f"{pipeline.url}{path}", data=body, method=method)
    req.add_header("x-api-key", key)  # Anthropic's clients' header
    req.add_header("Authorization", f"Bearer {key}")  # the OpenAI routes' (stored())
    req.add_header("anthropic-version", "2023-06-01")
    if body is not None:
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            status, data = resp.status, resp.read()
    except urllib.error.HTTPError as err:
        status, data = err.code, err.read()
    try:
        return status, json.loads(data)
    except ValueError:
        return status, data


def client(pipeline: Pipeline, key: str = DEV_KEY) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=pipeline.url, api_key=key, max_retries=0,
                                    timeout=30)


def req(custom_id: str, model: str = "tidegate-sim", **params: Any) -> dict[str, Any]:
    return {"custom_id": custom_id,
            "params": {"model": model, "max_tokens": 4, "messages": USER, **params}}


def create(pipeline: Pipeline, body: Any, key: str = DEV_KEY) -> tuple[int, Any]:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return call(pipeline, "POST", PATH, raw, key=key)


def anthropic_error(status: int, reply: Any, expected: int = 400) -> dict[str, Any]:
    assert status == expected, (status, reply)
    assert isinstance(reply, dict), reply
    assert reply["type"] == "error", reply
    error: dict[str, Any] = reply["error"]
    assert error["type"] == ("request_too_large" if expected == 413
                             else "invalid_request_error"), reply
    return error


def stored(pipeline: Pipeline, key: str = DEV_KEY) -> tuple[int, int]:
    """(batches, input files) the tenant has: a refused create adds neither."""
    _, batches = call(pipeline, "GET", "/v1/batches?limit=1000", key=key)
    _, files = call(pipeline, "GET", "/v1/files?purpose=batch", key=key)
    return len(batches["data"]), len(files["data"])


HOSTILE: list[tuple[Any, str]] = [
    ({}, "requests"),
    ({"requests": []}, "requests"),
    ({"requests": "all"}, "requests"),
    ({"requests": [req(f"r{i}") for i in range(MAX_LINES + 1)]}, "requests"),
    ({"requests": [None]}, "requests[0]"),
    ({"requests": [{"params": req("x")["params"]}]}, "requests[0].custom_id"),
    ({"requests": [req("")]}, "requests[0].custom_id"),
    ({"requests": [req("x" * 65)]}, "requests[0].custom_id"),
    ({"requests": [req("a/../b")]}, "requests[0].custom_id"),
    ({"requests": [req("tg.>")]}, "requests[0].custom_id"),
    ({"requests": [req("a\r\nb")]}, "requests[0].custom_id"),
    ({"requests": [req("ok"), req("dup"), req("dup")]}, "requests[2].custom_id"),
    ({"requests": [{"custom_id": "a"}]}, "requests[0].params"),
    ({"requests": [req("a"), req("b", model="no-such-model")]}, "requests[1].params"),
    ({"requests": [req("a", max_tokens=0)]}, "requests[0].params"),
    ({"requests": [req("a", max_tokens=1 << 64)]}, "requests[0].params"),
    ({"requests": [req("a", messages=[])]}, "requests[0].params"),
    ({"requests": [req("a", messages=[{"role": "root", "content": "x"}])]},
     "requests[0].params"),
    ({"requests": [req("a", x=1 << 70)]}, "requests[0].params"),
    ({"requests": [req("a", system="x" * MAX_LINE)]}, "requests[0]"),
    (b'{"requests":[{"custom_id":"a","params":{"model":"tidegate-sim","model":"x",'
     b'"max_tokens":4,"messages":[{"role":"user","content":"hi"}]}}]}', "requests[0].params"),
    (b'{"requests":[{"custom_id":"a","custom_id":"b","params":{"model":"tidegate-sim",'
     b'"max_tokens":4,"messages":[{"role":"user","content":"hi"}]}}]}', "requests[0]"),
]


async def test_hostile_creates_are_anthropic_400s(pipeline: Pipeline) -> None:
    before = stored(pipeline)
    for body, where in HOSTILE:
        error = anthropic_error(*create(pipeline, body))
        assert error["message"].startswith(where), (where, error)
    for raw in (b"", b"null", b"[]", b"{", b'{"requests":' + b"[" * 100_000,
                b'{"requests":[],"requests":[]}', b"\xff\xfe"):
        anthropic_error(*create(pipeline, raw))
    assert stored(pipeline) == before


async def test_nasty_bodies_as_params_are_4xx_never_500(pipeline: Pipeline) -> None:
    before = stored(pipeline)
    accepted = 0
    for nasty in NASTY_BODIES:
        raw = b'{"requests":[{"custom_id":"n","params":' + nasty + b"}]}"
        status, reply = create(pipeline, raw)
        assert 400 <= status < 500, (nasty[:80], status, reply)
        assert reply["type"] == "error", reply
        # ... and with max_tokens, which each lacks: the verdict of POST /v1/messages.
        try:
            params = json.loads(nasty)
        except (ValueError, RecursionError):
            continue
        if not isinstance(params, dict):
            continue
        params["max_tokens"] = 4
        alone, _ = call(pipeline, "POST", "/v1/messages", json.dumps(params).encode())
        status, reply = create(pipeline, {"requests": [{"custom_id": "n", "params": params}]})
        # (a body past edge.max_body_bytes is 413 on both routes)
        assert status == (alone if alone in (200, 413) else 400), (nasty[:80], alone, reply)
        accepted += status == 200
    batches, files = stored(pipeline)
    assert (batches, files) == (before[0] + accepted, before[1] + accepted)
    assert pipeline.edge.running
    async with client(pipeline) as c:  # the edge still serves
        assert (await c.messages.create(model="tidegate-sim", max_tokens=4,
                                        messages=USER)).content  # type: ignore[arg-type]


async def test_too_large(pipeline: Pipeline) -> None:
    many = {"requests": [req(f"r{i}", system="x" * (MAX_LINE // 2)) for i in range(40)]}
    anthropic_error(*create(pipeline, many), expected=413)


async def test_storage_quota_counts_the_requests(pipeline: Pipeline) -> None:
    key = await key_of(pipeline, "quota-" + uuid.uuid4().hex[:6])
    half = {"requests": [req(f"r{i}", system="x" * (MAX_LINE // 2)) for i in range(5)]}
    status, batch = create(pipeline, half, key=key)
    assert status == 200, batch
    error = anthropic_error(*create(pipeline, half, key=key), expected=413)
    assert "quota" in error["message"]
    assert stored(pipeline, key) == (1, 1)


async def test_another_tenant_gets_404(pipeline: Pipeline) -> None:
    other_key = await key_of(pipeline, "other-" + uuid.uuid4().hex[:6])
    async with client(pipeline) as mine, client(pipeline, other_key) as other:
        batch = await mine.messages.batches.create(requests=[req("a"), req("b")])  # type: ignore[list-item]
        for attempt in (other.messages.batches.retrieve(batch.id),
                        other.messages.batches.cancel(batch.id)):
            with pytest.raises(anthropic.NotFoundError):
                await attempt
        assert batch.id not in [b.id async for b in other.messages.batches.list()]
        deadline = time.monotonic() + 60
        while (await mine.messages.batches.retrieve(batch.id)).processing_status != "ended":
            assert time.monotonic() < deadline
            await asyncio.sleep(0.2)
        # The results too, though their URL is no secret.
        status, reply = call(pipeline, "GET", f"{PATH}/{batch.id}/results", key=other_key)
        assert status == 404
        assert reply["error"]["type"] == "not_found_error"
        assert len([r async for r in await mine.messages.batches.results(batch.id)]) == 2
        assert batch.id in [b.id async for b in mine.messages.batches.list()]


async def test_ids_not_ours_and_list_params(pipeline: Pipeline) -> None:
    # An OpenAI batch of chat completions is no Message Batch, under any id.
    async with openai.AsyncOpenAI(base_url=pipeline.base_url, api_key=DEV_KEY,
                                  max_retries=0, timeout=30) as oa:
        line = {"custom_id": "c", "method": "POST", "url": "/v1/chat/completions",
                "body": {"model": "tidegate-sim", "max_tokens": 4, "messages": USER}}
        file = await oa.files.create(file=("in.jsonl", io.BytesIO(json.dumps(line).encode())),
                                     purpose="batch")
        chat = await oa.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions",
                                       completion_window="24h")
    hexes = ["0" * 32, chat.id.removeprefix("batch_")]
    for bad in [f"batch_{h}" for h in hexes] + [f"msgbatch_{h}" for h in hexes] + [
            "msgbatch_..%2F..%2Fx", "msgbatch_" + "a" * 5000, "msgbatch_%00", "x"]:
        for method, path in (("GET", f"{PATH}/{bad}"), ("POST", f"{PATH}/{bad}/cancel"),
                             ("GET", f"{PATH}/{bad}/results")):
            status, reply = call(pipeline, method, path, b"" if method == "POST" else None)
            assert status == 404, (method, path, reply)
            assert reply["type"] == "error", reply
    for query in ("limit=0", "limit=1001", "limit=x", "after_id=a&before_id=b"):
        anthropic_error(*call(pipeline, "GET", f"{PATH}?{query}"))
    _, listed = call(pipeline, "GET", f"{PATH}?limit=1000")
    assert "msgbatch_" + hexes[1] not in [b["id"] for b in listed["data"]]


async def test_list_pages_both_ways(pipeline: Pipeline) -> None:
    ids = [create(pipeline, {"requests": [req("p")]})[1]["id"] for _ in range(3)]
    _, everything = call(pipeline, "GET", f"{PATH}?limit=1000")
    assert set(ids) <= {b["id"] for b in everything["data"]}
    _, page = call(pipeline, "GET", f"{PATH}?limit=2")
    newest = [b["id"] for b in page["data"]]
    assert newest == [b["id"] for b in everything["data"][:2]]
    assert page["has_more"]
    assert page["first_id"] == newest[0]
    assert page["last_id"] == newest[1]
    _, older = call(pipeline, "GET", f"{PATH}?limit=2&after_id={newest[1]}")
    _, back = call(pipeline, "GET", f"{PATH}?limit=2&before_id={older['data'][0]['id']}")
    assert [b["id"] for b in back["data"]] == newest


async def test_results_before_the_end_are_400(pipeline: Pipeline) -> None:
    status, batch = create(pipeline, {"requests": [req(f"s{i}", model="slow-sim",
                                                       max_tokens=20) for i in range(8)]})
    assert status == 200, batch
    assert batch["results_url"] is None
    error = anthropic_error(*call(pipeline, "GET", f"{PATH}/{batch['id']}/results"))
    assert "not ended" in error["message"]
    call(pipeline, "POST", f"{PATH}/{batch['id']}/cancel", b"")


@pytest.fixture(scope="module")
def short_window(tmp_path_factory: pytest.TempPathFactory, module_nats_url: str,
                 module_redis_url: str) -> Iterator[Pipeline]:
    """Batches end 3 s after they are created (``batch.max_window``)."""
    yield from running_pipeline(
        tmp_path_factory.mktemp("msgbatch_expiry"), module_nats_url, module_redis_url,
        overrides={"models": _models(), "batch": {"lease": 1.0, "max_window": 3.0},
                   "nats": {"subject_prefix": "x" + uuid.uuid4().hex[:6]}})


@pytest.fixture
async def short_client(short_window: Pipeline) -> AsyncIterator[anthropic.AsyncAnthropic]:
    async with client(short_window) as c:
        yield c


async def test_a_window_that_ends_expires_the_rest(short_client: anthropic.AsyncAnthropic,
                                                   ) -> None:
    # 2 slots, ~1 s a request: 12 requests need ~6 s, the window is 3 s.
    requests = [req(f"e{i}", model="slow-sim", max_tokens=20) for i in range(12)]
    batch = await short_client.messages.batches.create(requests=requests)  # type: ignore[arg-type]
    assert batch.expires_at.timestamp() - batch.created_at.timestamp() == 3
    deadline = time.monotonic() + 120
    while (batch := await short_client.messages.batches.retrieve(batch.id)).processing_status \
            != "ended":
        assert time.monotonic() < deadline, batch
        await asyncio.sleep(0.2)
    counts = batch.request_counts
    assert counts.expired >= 1
    assert counts.succeeded + counts.errored + counts.expired == 12
    assert counts.canceled == 0
    results = [r async for r in await short_client.messages.batches.results(batch.id)]
    assert sorted(r.custom_id for r in results) == sorted(r["custom_id"] for r in requests)
    assert [r.result.type for r in results].count("expired") == counts.expired
