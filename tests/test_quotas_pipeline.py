"""Quotas through the whole pipeline: real NATS, real Redis, dispatcher processes.

Tenants, keys and policies are set the way an operator does (KV), and every
assertion is on what clients see: status codes, headers, error bodies.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from pathlib import Path
from typing import Any

import aiohttp
import nats
import pytest

from tests.pipeline import Pipeline
from tidegate.control.keys import create_key, ensure_keys_bucket
from tidegate.control.policies import Policy, ensure_policies_bucket, set_policy
from tidegate.wire.protocol import Api
from tidegate.wire.tokens import reservation

pytestmark = pytest.mark.pipeline


def start_pipeline(tmp_path: Path, nats_url: str, redis_url: str, dispatchers: int = 1,
                   **sections: dict[str, Any]) -> Pipeline:
    overrides: dict[str, Any] = {
        "nats": {"subject_prefix": "q" + uuid.uuid4().hex[:8]},
        "models": [{"name": "tidegate-sim", "max_streams": 256,
                    "simulator": {"ttft": 0.0, "tokens_per_second": 5000.0, "length": 32}}],
    }
    for section, values in sections.items():
        overrides.setdefault(section, {}).update(values)
    pipeline = Pipeline(tmp_path, nats_url, redis_url, overrides=overrides)
    for i in range(1, dispatchers):
        pipeline.dispatchers.append(pipeline._process("dispatcher", f"dispatcher{i}"))
    pipeline.start()
    return pipeline


async def provision(pipeline: Pipeline, nats_url: str, tenant: str,
                    policies: list[Policy]) -> str:
    """Create a key for ``tenant`` and set ``policies``; returns the key."""
    nc = await nats.connect(nats_url)
    try:
        js = nc.jetstream()
        key, _ = await create_key(await ensure_keys_bucket(js, pipeline.config), tenant)
        kv = await ensure_policies_bucket(js, pipeline.config)
        for policy in policies:
            await set_policy(kv, policy)
    finally:
        await nc.close()
    return key


async def chat(session: aiohttp.ClientSession, pipeline: Pipeline, key: str,
               max_tokens: int = 8, content: str = "hello") -> tuple[int, dict[str, str], Any]:
    body = {"model": "tidegate-sim", "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": content}]}
    async with session.post(f"{pipeline.url}/v1/chat/completions", json=body,
                            headers={"Authorization": f"Bearer {key}"}) as resp:
        return resp.status, dict(resp.headers), await resp.json()


async def until_status(session: aiohttp.ClientSession, pipeline: Pipeline, key: str,
                       status: int, within: float) -> float:
    """Seconds until a request gets ``status``; fails after ``within``."""
    start = time.monotonic()
    while time.monotonic() - start < within:
        got, _, _ = await chat(session, pipeline, key, max_tokens=1)
        if got == status:
            return time.monotonic() - start
        await asyncio.sleep(0.05)
    raise AssertionError(f"no {status} within {within}s (last {got})")


@pytest.fixture
def redis_url(redis_server: Any) -> str:
    return str(redis_server.url)


# ---------------------------------------------------------------------------


async def test_tpm_limit_is_exact_across_three_dispatchers(
        tmp_path: Path, module_nats_url: str, redis_url: str) -> None:
    limit = 6000
    pipeline = start_pipeline(tmp_path, module_nats_url, redis_url, dispatchers=3)
    try:
        key = await provision(pipeline, module_nats_url, "acme", [Policy(tenant="acme",
                                                                          tpm=limit)])
        await asyncio.sleep(0.5)  # policies reach the dispatchers' watchers
        body = {"model": "tidegate-sim", "max_tokens": 50,
                "messages": [{"role": "user", "content": "hello"}]}
        cost = reservation(Api.CHAT, body, 1024)
        n = int(limit / cost * 1.6)  # a burst well past the limit
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            results = await asyncio.gather(*(chat(session, pipeline, key, max_tokens=50)
                                             for _ in range(n)))
    finally:
        pipeline.stop()
    statuses = [status for status, _, _ in results]
    admitted = statuses.count(200)
    assert set(statuses) <= {200, 429}, statuses
    # What a window holds once the burst is over: the actual usage of every
    # admitted request (reservations are reconciled down to it, which is why
    # a few more requests than limit / reservation get in).
    admitted_tokens = sum(b["usage"]["total_tokens"] for s, _, b in results if s == 200)
    print(f"{n} requests reserving {cost} tokens against {limit} TPM on 3 dispatchers: "
          f"{admitted} admitted, {admitted_tokens} tokens used")
    assert admitted_tokens <= limit + cost, "over the limit by more than one reservation"
    assert admitted_tokens >= limit * 0.98 - cost, "admitted well below the limit"
    rejected = [(h, b) for s, h, b in results if s == 429]
    headers, error_body = rejected[0]
    assert error_body["error"]["type"] == "rate_limit_error"
    assert error_body["error"]["code"] == "rate_limit_tokens"
    assert "tokens per minute" in error_body["error"]["message"]
    assert int(headers["Retry-After"]) >= 1
    assert headers["x-ratelimit-limit-tokens"] == str(limit)
    assert int(headers["x-ratelimit-remaining-tokens"]) < cost
    assert headers["x-ratelimit-reset-tokens"].endswith("s")


async def test_policy_change_applies_within_a_second(
        tmp_path: Path, module_nats_url: str, redis_url: str) -> None:
    pipeline = start_pipeline(tmp_path, module_nats_url, redis_url)
    try:
        key = await provision(pipeline, module_nats_url, "hot", [Policy(tenant="hot", rpm=1)])
        await asyncio.sleep(0.5)
        async with aiohttp.ClientSession() as session:
            await until_status(session, pipeline, key, 429, within=5)
            status, headers, _ = await chat(session, pipeline, key)
            assert status == 429
            assert headers["x-ratelimit-limit-requests"] == "1"
            await provision(pipeline, module_nats_url, "hot", [Policy(tenant="hot", rpm=10_000)])
            took = await until_status(session, pipeline, key, 200, within=3)
    finally:
        pipeline.stop()
    print(f"policy change applied after {took * 1000:.0f} ms")
    assert took < 1.0


async def test_redis_outage_fails_closed_then_recovers(
        tmp_path: Path, module_nats_url: str, redis_server: Any) -> None:
    pipeline = start_pipeline(tmp_path, module_nats_url, redis_server.url)
    try:
        key = await provision(pipeline, module_nats_url, "t", [Policy(tenant="t", rpm=10_000)])
        await asyncio.sleep(0.5)
        async with aiohttp.ClientSession() as session:
            await until_status(session, pipeline, key, 200, within=5)
            redis_server.kill()
            status, headers, error = await chat(session, pipeline, key)
            assert status == 503
            assert error["error"]["code"] == "quota_store_unavailable"
            assert "Retry-After" in headers
            await asyncio.to_thread(redis_server.restart)
            took = await until_status(session, pipeline, key, 200, within=10)
    finally:
        pipeline.stop()
    print(f"recovered {took:.2f}s after redis came back")
    log = (pipeline.workdir / "logs" / "dispatcher.log").read_text()
    assert "quota store unavailable" in log


async def test_redis_outage_fails_open_when_configured(
        tmp_path: Path, module_nats_url: str, redis_server: Any) -> None:
    pipeline = start_pipeline(tmp_path, module_nats_url, redis_server.url,
                              dispatcher={"quota_failure": "open"})
    try:
        key = await provision(pipeline, module_nats_url, "t", [Policy(tenant="t", rpm=10_000)])
        await asyncio.sleep(0.5)
        async with aiohttp.ClientSession() as session:
            await until_status(session, pipeline, key, 200, within=5)
            redis_server.kill()
            status, _, body = await chat(session, pipeline, key)
            assert status == 200, body
            await asyncio.to_thread(redis_server.restart)
            await until_status(session, pipeline, key, 200, within=10)
    finally:
        pipeline.stop()


async def test_concurrency_slot_is_released_when_the_stream_ends(
        tmp_path: Path, module_nats_url: str, redis_url: str) -> None:
    pipeline = start_pipeline(tmp_path, module_nats_url, redis_url)
    try:
        key = await provision(pipeline, module_nats_url, "c",
                              [Policy(tenant="c", concurrency=1)])
        await asyncio.sleep(0.5)
        async with aiohttp.ClientSession() as session:
            body = {"model": "tidegate-sim", "stream": True, "max_tokens": 400,
                    "messages": [{"role": "user", "content": "long"}]}
            async with session.post(f"{pipeline.url}/v1/chat/completions", json=body,
                                    headers={"Authorization": f"Bearer {key}"}) as first:
                assert first.status == 200
                status, _, error = await chat(session, pipeline, key)
                assert status == 429
                assert error["error"]["code"] == "rate_limit_concurrency"
                await first.read()
            # The worker's usage record releases the slot.
            took = await until_status(session, pipeline, key, 200, within=5)
    finally:
        pipeline.stop()
    assert took < 5


async def test_key_restricted_to_models_gets_403(
        tmp_path: Path, module_nats_url: str, redis_url: str) -> None:
    pipeline = start_pipeline(tmp_path, module_nats_url, redis_url)
    try:
        nc = await nats.connect(module_nats_url)
        try:
            kv = await ensure_keys_bucket(nc.jetstream(), pipeline.config)
            key, _ = await create_key(kv, "m", models=["other-model"])
        finally:
            await nc.close()
        await asyncio.sleep(0.5)
        async with aiohttp.ClientSession() as session:
            status, _, error = await chat(session, pipeline, key)
    finally:
        pipeline.stop()
    assert status == 403
    assert error["error"]["code"] == "model_not_allowed"
    assert json.dumps(error)
