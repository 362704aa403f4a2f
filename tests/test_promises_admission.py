"""What the docs promise about admission and no other test proved against real
servers (issue 26):

* docs/queue-mode.md: a model in queue mode with ``max_queued`` requests
  waiting answers one more with 503 ``queue_full`` and ``Retry-After: 5`` at
  once, and refunds its quota reservation (reconciled to 0 tokens).
* docs/quotas.md: "a request to which no policy applies is admitted without
  a Redis call at all": with Redis gone and ``quota_failure = "closed"``,
  such a request still runs while one a policy concerns gets 503
  ``quota_store_unavailable``.

Each was seen failing with the promise broken.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import nats
import pytest

from bench.fake_backend import FakeBackend
from dispatcher.queueing import QueueMode
from dispatcher.quota import QuotaStore
from dispatcher.quota import connect as connect_redis
from tests.pipeline import Pipeline, record_for, threaded_fake_backend
from tests.poll import eventually
from tidegate.control.keys import create_key, ensure_keys_bucket
from tidegate.control.policies import Policy, ensure_policies_bucket, set_policy

pytestmark = pytest.mark.pipeline

MAX_QUEUED = 2
# Queue mode after one slow window; it never leaves it within the test.
QUEUE = {"ttft_p99": 0.05, "window": 0.5, "enter_after": 1, "exit_after": 1000,
         "exit_ratio": 0.7, "ttl": 120.0, "max_queued": MAX_QUEUED, "min_concurrency": 1}


@pytest.fixture(scope="module")
def backend() -> Iterator[FakeBackend]:
    with threaded_fake_backend(models=["fake"], ttft=0.01, itl=0.001, tokens=4) as fake:
        yield fake


async def provisioned(tmp_path: Path, nats_url: str, redis_url: str, backend: FakeBackend,
                      policies: list[Policy], tenants: list[str],
                      **sections: dict[str, Any]) -> tuple[Pipeline, dict[str, str]]:
    """Keys for ``tenants`` and the ``policies`` stored, then the pipeline
    started (so every tier has them before it serves)."""
    overrides: dict[str, Any] = {
        "nats": {"subject_prefix": "a" + uuid.uuid4().hex[:8]},
        "models": [{"name": "fake", "backend": "openai", "base_url": backend.base_url,
                    "max_streams": 64, "queue": QUEUE}]}
    for section, values in sections.items():
        overrides.setdefault(section, {}).update(values)
    pipeline = Pipeline(tmp_path, nats_url, redis_url, overrides=overrides)
    nc = await nats.connect(nats_url)
    try:
        js = nc.jetstream()
        keys_kv = await ensure_keys_bucket(js, pipeline.config)
        keys = {tenant: (await create_key(keys_kv, tenant))[0] for tenant in tenants}
        policies_kv = await ensure_policies_bucket(js, pipeline.config)
        for policy in policies:
            await set_policy(policies_kv, policy)
    finally:
        await nc.close()
    try:
        await asyncio.to_thread(pipeline.start)
    except BaseException:
        pipeline.stop()
        raise
    return pipeline, keys


async def chat(session: aiohttp.ClientSession, pipeline: Pipeline, key: str,
               ttft: float = 0.0, content: str = "q") -> tuple[int, Any, Any]:
    body = {"model": "fake", "max_tokens": 3, "fake_ttft": ttft,
            "messages": [{"role": "user", "content": content}]}
    async with session.post(f"{pipeline.url}/v1/chat/completions", json=body,
                            headers={"Authorization": f"Bearer {key}"}) as resp:
        return resp.status, resp.headers.copy(), await resp.json()


async def test_queue_full_is_503_with_retry_after_and_refunds_the_reservation(
        tmp_path: Path, module_nats_url: str, redis_server: Any, backend: FakeBackend) -> None:
    policy = Policy(tenant="acme", tpm=10_000_000)
    pipeline, keys = await provisioned(tmp_path, module_nats_url, redis_server.url, backend,
                                       [policy], ["acme"])
    key = keys["acme"]
    redis = connect_redis(redis_server.url, 2.0)
    queue = QueueMode(redis, pipeline.config.nats.subject_prefix)
    held: list[asyncio.Task[Any]] = []
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            async def queueing() -> bool:
                if (await redis.hgetall(queue.state_key("fake"))).get("mode") == "queue":
                    return True
                await asyncio.gather(*(chat(session, pipeline, key, ttft=0.2)
                                       for _ in range(2)))
                return False

            await eventually(queueing, 60, "the slow backend put the model in queue mode")
            limit = int((await redis.hgetall(queue.state_key("fake")))["limit"])
            # What may run, then what may wait: all of them held (the backend
            # answers after 10 minutes; they are cancelled at the end).
            running = f"running-{uuid.uuid4().hex}"
            held = [asyncio.create_task(chat(session, pipeline, key, ttft=600.0,
                                             content=running)) for _ in range(limit)]
            await eventually(lambda: len(record_for(backend, running)) == limit, 60,
                             f"{limit} requests running at the backend")
            held += [asyncio.create_task(chat(session, pipeline, key, ttft=600.0))
                     for _ in range(MAX_QUEUED)]
            await eventually(lambda: _queued(queue, MAX_QUEUED), 60,
                             f"{MAX_QUEUED} requests waiting in the queue")
            status, headers, body = await chat(session, pipeline, key)
            assert not any(task.done() for task in held), \
                (limit, [task.result()[::2] for task in held if task.done()])
        assert status == 503, body
        assert body["error"]["code"] == "queue_full"
        assert headers["Retry-After"] == "5"
        # The refund: its reservation in the tenant's window is reconciled to 0.
        request_id = headers["x-request-id"]
        store = QuotaStore(redis, prefix=pipeline.config.nats.subject_prefix)
        _, reserved_key, _, _ = store.scope_keys(policy.scope_id)
        assert await redis.hget(reserved_key, request_id) is not None  # it was charged
        await eventually(lambda: _refunded(redis, reserved_key, request_id), 15,
                         "the rejected request's reservation reconciled to 0")
    finally:
        for task in held:
            task.cancel()
        await asyncio.gather(*held, return_exceptions=True)
        await redis.aclose()
        pipeline.stop()


async def _queued(queue: QueueMode, at_least: int) -> bool:
    return await queue.queued("fake") >= at_least


async def _refunded(redis: Any, key: str, request_id: str) -> bool:
    return bool(await redis.hget(key, request_id) == "0")


async def test_a_request_no_policy_concerns_is_admitted_with_redis_gone(
        tmp_path: Path, module_nats_url: str, redis_server: Any, backend: FakeBackend) -> None:
    pipeline, keys = await provisioned(
        tmp_path, module_nats_url, redis_server.url, backend,
        [Policy(tenant="metered", rpm=10_000)], ["metered", "free"],
        dispatcher={"quota_failure": "closed"})
    try:
        async with aiohttp.ClientSession() as session:
            for key in keys.values():
                status, _, body = await chat(session, pipeline, key)
                assert status == 200, body
            redis_server.kill()
            # The metered tenant shows Redis is gone and the dispatcher fails closed ...
            status, _, body = await chat(session, pipeline, keys["metered"])
            assert status == 503, body
            assert body["error"]["code"] == "quota_store_unavailable"
            # ... while the tenant no policy concerns never needed it.
            for _ in range(3):
                status, headers, body = await chat(session, pipeline, keys["free"])
                assert status == 200, body
                assert "x-ratelimit-limit-requests" not in headers
    finally:
        pipeline.stop()
