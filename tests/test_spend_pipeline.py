"""Spend through the whole pipeline: real NATS, real Redis, edge, dispatcher(s),
worker. Every cost is checked exactly against the usage record's tokens at
the model's price; budgets are set the way an operator does (KV)."""

from __future__ import annotations

import asyncio
import json
import re
import uuid
from collections.abc import AsyncIterator, Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import aiohttp
import nats
import pytest

from tests.pipeline import DEV_KEY, Pipeline, running_pipeline, threaded_fake_backend, usage_of
from tests.poll import eventually
from tidegate.apis import estimate_prompt_tokens
from tidegate.control.budgets import Budget, ensure_budgets_bucket, set_budget
from tidegate.control.keys import create_key, ensure_keys_bucket
from tidegate.control.prices import Price, ensure_prices_bucket, format_money, set_price
from tidegate.wire.protocol import Api

pytestmark = pytest.mark.pipeline

SIM_PRICE = Price("tidegate-sim", input=Decimal("2.5"), cached_input=Decimal("1.25"),
                  output=Decimal("10"), request=Decimal("0.0001"))
FAKE_PRICE = Price("org/fake", input=Decimal("3"), cached_input=Decimal("0.3"),
                   output=Decimal("15"))


def _models(fake_url: str, tps: float = 400.0) -> list[dict[str, Any]]:
    return [
        {"name": "tidegate-sim", "price_input": 2.5, "price_cached_input": 1.25,
         "price_output": 10.0, "price_request": 0.0001, "max_streams": 256,
         "simulator": {"ttft": 0.01, "tokens_per_second": tps, "length": 32}},
        {"name": "org/fake", "backend": "openai", "base_url": fake_url,
         "upstream_model": "fake-model", "price_input": 3.0, "price_cached_input": 0.3,
         "price_output": 15.0},
    ]


@pytest.fixture(scope="module")
def fake_url() -> Iterator[str]:
    with threaded_fake_backend(models=["fake-model"], ttft=0.01, itl=0.002,
                               tokens=12) as backend:
        yield backend.base_url


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory: pytest.TempPathFactory, module_nats_url: str,
             module_redis_url: str, fake_url: str) -> Iterator[Pipeline]:
    yield from running_pipeline(
        tmp_path_factory.mktemp("spend"), module_nats_url, module_redis_url,
        overrides={"nats": {"subject_prefix": "s" + uuid.uuid4().hex[:8]},
                   "models": _models(fake_url)}, metrics=True)


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


def chat_body(model: str, stream: bool, max_tokens: int = 8, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "stream": stream, "max_tokens": max_tokens,
                            "messages": [{"role": "user", "content": "hello there"}], **extra}
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


async def post(session: aiohttp.ClientSession, url: str, body: dict[str, Any],
               headers: dict[str, str] | None = None, key: str = DEV_KEY,
               ) -> tuple[int, dict[str, str], bytes]:
    async with session.post(f"{url}/v1/chat/completions", json=body,
                            headers={"Authorization": f"Bearer {key}", **(headers or {})}) as r:
        return r.status, {k.lower(): v for k, v in r.headers.items()}, await r.read()


def events(raw: bytes) -> list[dict[str, Any]]:
    out = []
    for line in raw.decode().splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            out.append(json.loads(line[6:]))
    return out


# -- cost on every request -------------------------------------------------------


async def test_streamed_cost_in_the_usage_chunk_only_when_asked(
        pipeline: Pipeline, session: aiohttp.ClientSession) -> None:
    status, headers, raw = await post(session, pipeline.url, chat_body("tidegate-sim", True),
                                      {"x-tidegate-cost": "include"})
    assert status == 200, raw
    chunks = events(raw)
    last = chunks[-1]
    assert last["choices"] == []
    assert last["usage"]["completion_tokens"] == 8
    record = (await usage_of(pipeline.config, headers["x-request-id"]))[0]
    expected = SIM_PRICE.cost(record.prompt_tokens, record.completion_tokens)
    assert record.cost_nanos == expected
    assert record.currency == "USD"
    assert last["x_tidegate"] == {"cost": format_money(expected), "currency": "USD"}
    # Not asked: no chunk carries the extension (OpenAI clients see OpenAI's shape).
    status, _, raw = await post(session, pipeline.url, chat_body("tidegate-sim", True))
    assert status == 200
    assert all("x_tidegate" not in c for c in events(raw))


async def test_non_streamed_cost_header_is_the_records_cost(
        pipeline: Pipeline, session: aiohttp.ClientSession) -> None:
    status, headers, raw = await post(session, pipeline.url,
                                      chat_body("tidegate-sim", False, max_tokens=5))
    assert status == 200, raw
    record = (await usage_of(pipeline.config, headers["x-request-id"]))[0]
    assert record.completion_tokens == 5
    expected = SIM_PRICE.cost(record.prompt_tokens, 5)
    assert record.cost_nanos == expected
    assert headers["x-tidegate-cost"] == format_money(expected)
    assert headers["x-tidegate-currency"] == "USD"


@pytest.mark.parametrize("stream", [False, True])
async def test_cached_prompt_tokens_are_billed_at_the_cached_price(
        pipeline: Pipeline, session: aiohttp.ClientSession, stream: bool) -> None:
    body = chat_body("org/fake", stream, max_tokens=6, fake_cached_tokens=2)
    status, headers, raw = await post(session, pipeline.url, body,
                                      {"x-tidegate-cost": "include"})
    assert status == 200, raw
    record = (await usage_of(pipeline.config, headers["x-request-id"]))[0]
    assert record.cached_tokens == 2
    assert record.prompt_tokens > 2
    expected = FAKE_PRICE.cost(record.prompt_tokens, record.completion_tokens, 2)
    assert expected < FAKE_PRICE.cost(record.prompt_tokens, record.completion_tokens)
    assert record.cost_nanos == expected
    if stream:
        assert events(raw)[-1]["x_tidegate"]["cost"] == format_money(expected)
    else:
        assert headers["x-tidegate-cost"] == format_money(expected)


async def test_cancelled_stream_pays_for_its_partial_usage(
        tmp_path: Path, module_nats_url: str, redis_server: Any, fake_url: str) -> None:
    """The client leaves mid-stream: the record costs the partial usage, and
    the tenant's budget, charged the whole reservation at admission, is
    reconciled down to exactly that."""
    import time
    import zoneinfo

    import redis.asyncio as aioredis

    from tidegate.control.budgets import period_window

    budget = Budget("default", Decimal("10"), period="day")
    pipeline = Pipeline(tmp_path, module_nats_url, redis_server.url, overrides={
        "nats": {"subject_prefix": "s" + uuid.uuid4().hex[:8]},
        "models": _models(fake_url, tps=20.0)})
    nc = await nats.connect(module_nats_url)
    try:
        await set_budget(await ensure_budgets_bucket(nc.jetstream(), pipeline.config), budget)
    finally:
        await nc.close()
    await asyncio.to_thread(pipeline.start)
    prefix = pipeline.config.nats.subject_prefix
    label = period_window(budget, time.time(), zoneinfo.ZoneInfo("UTC")).label
    total_key = f"{prefix}:{{{prefix}q}}:b:{budget.budget_id}:{label}:t"
    store = aioredis.Redis.from_url(redis_server.url, decode_responses=True)
    try:
        async with aiohttp.ClientSession() as session, session.post(
                f"{pipeline.url}/v1/chat/completions",
                json=chat_body("tidegate-sim", True, max_tokens=200),
                headers={"Authorization": f"Bearer {DEV_KEY}"}) as resp:
            request_id = resp.headers["x-request-id"]
            seen = 0
            async for line in resp.content:
                seen += line.startswith(b"data: ")
                if seen >= 5:
                    break
            reserved = int(await store.get(total_key) or 0)
            resp.close()  # the client leaves mid-stream
        record = (await usage_of(pipeline.config, request_id, within=60))[0]

        # The total held this request's whole reservation (and what the
        # pipeline's readiness probe spent before); reconciled, it holds the
        # request's cost instead.
        body = chat_body("tidegate-sim", True, max_tokens=200)
        reservation = SIM_PRICE.cost(estimate_prompt_tokens(Api.CHAT, body), 200)
        expected = reserved - reservation + record.cost_nanos

        async def reconciled() -> bool:
            return int(await store.get(total_key) or 0) == expected

        await eventually(reconciled, within=30, what=f"the budget reconciled to {expected}")
    finally:
        await store.aclose()
        pipeline.stop()
    assert record.outcome == "cancelled"
    assert 0 < record.completion_tokens < 200
    assert record.cost_nanos == SIM_PRICE.cost(record.prompt_tokens, record.completion_tokens)
    assert reserved >= reservation > record.cost_nanos


async def test_a_price_change_applies_without_a_restart(
        pipeline: Pipeline, session: aiohttp.ClientSession) -> None:
    new = Price("tidegate-sim", input=Decimal("100"), output=Decimal("200"))
    nc = await nats.connect(pipeline.config.nats.url)
    try:
        await set_price(await ensure_prices_bucket(nc.jetstream(), pipeline.config), new)
        body = chat_body("tidegate-sim", False, max_tokens=4)

        async def priced_anew() -> bool:
            _, headers, _ = await post(session, pipeline.url, body)
            prompt = estimate_prompt_tokens(Api.CHAT, body)
            return headers.get("x-tidegate-cost") == format_money(new.cost(prompt, 4))

        await eventually(priced_anew, within=30, what="the new price")
    finally:
        kv = await ensure_prices_bucket(nc.jetstream(), pipeline.config)
        await kv.delete("tidegate-sim")
        await nc.close()


async def test_a_budget_set_live_applies_without_a_restart(
        pipeline: Pipeline, session: aiohttp.ClientSession) -> None:
    """A tenant of its own on the shared pipeline: admitted, then a budget
    smaller than one request's reservation is stored in KV, and the next
    requests get 429 budget_exceeded; other tenants are not affected."""
    nc = await nats.connect(pipeline.config.nats.url)
    try:
        js = nc.jetstream()
        key, _ = await create_key(await ensure_keys_bucket(js, pipeline.config), "hotbudget")
        body = chat_body("tidegate-sim", False, max_tokens=4)

        async def admitted() -> bool:  # the edge knows the new key
            return (await post(session, pipeline.url, body, key=key))[0] == 200

        await eventually(admitted, within=30, what="the new key to work")
        await set_budget(await ensure_budgets_bucket(js, pipeline.config),
                         Budget("hotbudget", Decimal("0.0000001"), period="week"))

        async def refused() -> bool:
            status, _, raw = await post(session, pipeline.url, body, key=key)
            return status == 429 and json.loads(raw)["error"]["code"] == "budget_exceeded"

        await eventually(refused, within=30, what="the new budget to refuse")
        assert (await post(session, pipeline.url, body))[0] == 200  # another tenant
    finally:
        await nc.close()


async def test_spend_counter_per_tenant_and_model(
        pipeline: Pipeline, session: aiohttp.ClientSession) -> None:
    status, _, _ = await post(session, pipeline.url, chat_body("tidegate-sim", False))
    assert status == 200

    def counted() -> bool:
        text = pipeline.scrape("worker0")
        return re.search(r'tidegate_spend[_a-zA-Z]*_total\{[^}]*tidegate_tenant="default"'
                         r'[^}]*\} [0-9.e-]+', text) is not None or re.search(
            r'tidegate_spend[_a-zA-Z]*_total\{[^}]*gen_ai_request_model="tidegate-sim"[^}]*'
            r'tidegate_tenant="default"', text) is not None

    await eventually(counted, within=30, what="tidegate_spend on the worker's /metrics")


# -- budgets ---------------------------------------------------------------------


async def start_with_budget(tmp_path: Path, nats_url: str, redis_url: str, fake_url: str,
                            budget: Budget, dispatchers: int = 1) -> tuple[Pipeline, str]:
    pipeline = Pipeline(tmp_path, nats_url, redis_url, overrides={
        "nats": {"subject_prefix": "s" + uuid.uuid4().hex[:8]},
        "models": _models(fake_url, tps=5000.0)})
    for i in range(1, dispatchers):
        pipeline.dispatchers.append(pipeline._process("dispatcher", f"dispatcher{i}"))
    nc = await nats.connect(nats_url)
    try:
        js = nc.jetstream()
        key, _ = await create_key(await ensure_keys_bucket(js, pipeline.config), budget.tenant)
        await set_budget(await ensure_budgets_bucket(js, pipeline.config), budget)
    finally:
        await nc.close()
    try:
        await asyncio.to_thread(pipeline.start)
    except BaseException:
        pipeline.stop()
        raise
    return pipeline, key


async def test_over_budget_is_429_budget_exceeded_with_retry_after(
        tmp_path: Path, module_nats_url: str, redis_server: Any, fake_url: str) -> None:
    body = chat_body("tidegate-sim", False, max_tokens=100)
    reserve = SIM_PRICE.cost(estimate_prompt_tokens(Api.CHAT, body), 100)
    budget = Budget("acme", Decimal(reserve * 3) / 10**9 + Decimal("0.0000001"),
                    period="day")
    pipeline, key = await start_with_budget(tmp_path, module_nats_url, redis_server.url,
                                            fake_url, budget)
    try:
        async with aiohttp.ClientSession() as session:
            results = [await post(session, pipeline.url, body, key=key) for _ in range(6)]
    finally:
        pipeline.stop()
    statuses = [s for s, _, _ in results]
    # Each reserves its cap but is reconciled to what it used (100 tokens, the
    # simulator writes them all): three fit, the fourth does not.
    assert statuses[:3] == [200, 200, 200], results
    assert 429 in statuses
    _, headers, raw = next(r for r in results if r[0] == 429)
    error = json.loads(raw)["error"]
    assert error["code"] == "budget_exceeded"
    assert error["type"] == "insufficient_quota"
    assert 0 < int(headers["retry-after"]) <= 86400  # the next local midnight
    assert Decimal(headers["x-ratelimit-remaining-budget"]) < Decimal(reserve) / 10**9
    ok_headers = results[0][1]
    assert "x-ratelimit-remaining-budget" in ok_headers


@pytest.mark.slow
async def test_three_dispatchers_never_overspend_a_budget(
        tmp_path: Path, module_nats_url: str, redis_server: Any, fake_url: str) -> None:
    """A burst of concurrent requests through 3 dispatcher processes against
    a budget of about 40 requests' reservations: the money actually spent
    (the usage records' costs) never passes it. The bound is zero overspend
    whenever a request costs at most what it reserved; the simulator's usage
    is its prompt estimate and at most max_tokens, so it does."""
    body = chat_body("tidegate-sim", False, max_tokens=50)
    reserve = SIM_PRICE.cost(estimate_prompt_tokens(Api.CHAT, body), 50)
    limit = reserve * 40
    budget = Budget("acme", Decimal(limit) / 10**9, period="month")
    pipeline, key = await start_with_budget(tmp_path, module_nats_url, redis_server.url,
                                            fake_url, budget, dispatchers=3)
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            results = await asyncio.gather(*(post(session, pipeline.url, body, key=key)
                                             for _ in range(80)))
            admitted = [h["x-request-id"] for s, h, _ in results if s == 200]
            records = [(await usage_of(pipeline.config, rid, within=60))[0]
                       for rid in admitted]
    finally:
        pipeline.stop()
    statuses = [s for s, _, _ in results]
    assert set(statuses) <= {200, 429}, statuses
    spent = sum(r.cost_nanos for r in records)
    assert spent <= limit, (spent, limit)
    # and the budget was used, not refused wholesale
    assert len(admitted) >= 38, statuses


async def test_batch_lines_are_costed_like_requests(pipeline: Pipeline) -> None:
    import io

    import openai

    lines = [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": "tidegate-sim", "max_tokens": 3 + i,
                       "messages": [{"role": "user", "content": f"line {i}"}]}}
             for i in range(4)]
    data = b"".join(json.dumps(line).encode() + b"\n" for line in lines)
    async with openai.AsyncOpenAI(base_url=pipeline.base_url, api_key=DEV_KEY,
                                  max_retries=0, timeout=30) as client:
        file = await client.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch")
        batch = await client.batches.create(input_file_id=file.id,
                                            endpoint="/v1/chat/completions",
                                            completion_window="24h")

        async def finished() -> Any:
            got = await client.batches.retrieve(batch.id)
            return got if got.status in ("completed", "failed", "expired") else None

        done = await eventually(finished, within=60, what="the batch to finish")
        assert done.status == "completed", done
        assert done.output_file_id is not None
        content = await client.files.content(done.output_file_id)
    outputs = [json.loads(line) for line in content.content.splitlines() if line.strip()]
    assert len(outputs) == 4
    for out in outputs:
        usage = out["response"]["body"]["usage"]
        record = (await usage_of(pipeline.config, out["response"]["request_id"]))[0]
        assert record.completion_tokens == usage["completion_tokens"]
        assert record.cost_nanos == SIM_PRICE.cost(usage["prompt_tokens"],
                                                   usage["completion_tokens"])
        assert record.cost_nanos > 0
