"""Queue mode on real servers: a slow backend drives a model into queue mode,
queued clients get positions, two backlogged tenants share the capacity
fairly, the TTL gives a clear error, and recovery leaves queue mode."""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path
from typing import Any

import aiohttp
import nats
import pytest

from dispatcher.quota import connect as connect_redis
from tests.pipeline import Pipeline, threaded_fake_backend
from tests.poll import eventually
from tidegate.control.keys import create_key, ensure_keys_bucket

pytestmark = pytest.mark.pipeline

QUEUE = {"ttft_p99": 0.2, "window": 1.0, "enter_after": 2, "exit_after": 2, "exit_ratio": 0.7,
         "ttl": 8.0, "max_queued": 150, "min_concurrency": 2}
BACKLOG = 50  # per tenant: more than the TTL lets through, so the tail expires


async def mode_of(redis_url: str, pipeline: Pipeline) -> dict[str, str]:
    from dispatcher.queueing import QueueMode

    client = connect_redis(redis_url, 2.0)
    try:
        queue = QueueMode(client, pipeline.config.nats.subject_prefix)
        return dict(await client.hgetall(queue.state_key("fake")))
    finally:
        await client.aclose()


async def queued(redis_url: str, pipeline: Pipeline, at_least: int) -> bool:
    from dispatcher.queueing import QueueMode

    client = connect_redis(redis_url, 2.0)
    try:
        return await QueueMode(client, pipeline.config.nats.subject_prefix).queued(
            "fake") >= at_least
    finally:
        await client.aclose()


async def wait_mode(redis_url: str, pipeline: Pipeline, mode: str, within: float,
                    load: Any = None) -> float:
    start = time.monotonic()
    while time.monotonic() - start < within:
        if (await mode_of(redis_url, pipeline)).get("mode") == mode:
            return time.monotonic() - start
        await asyncio.sleep(0.1)
    raise AssertionError(f"not in {mode} mode after {within}s: "
                         f"{await mode_of(redis_url, pipeline)}")


async def test_queue_mode_end_to_end(tmp_path: Path, module_nats_url: str,
                                     redis_server: Any) -> None:
    with threaded_fake_backend(models=["fake"], ttft=0.01, itl=0.001, tokens=10**6) as fake:
        pipeline = Pipeline(tmp_path, module_nats_url, redis_server.url, overrides={
            "nats": {"subject_prefix": "qm" + uuid.uuid4().hex[:6]},
            "models": [{"name": "fake", "backend": "openai", "base_url": fake.base_url,
                        "max_streams": 64, "queue": QUEUE}]})
        try:
            await run_scenario(pipeline, module_nats_url, redis_server.url)
        finally:
            pipeline.stop()


async def run_scenario(pipeline: Pipeline, nats_url: str, redis_url: str) -> None:
    nc = await nats.connect(nats_url)
    try:
        kv = await ensure_keys_bucket(nc.jetstream(), pipeline.config)
        key_a, _ = await create_key(kv, "tenant-a")
        key_b, _ = await create_key(kv, "tenant-b")
    finally:
        await nc.close()
    await asyncio.to_thread(pipeline.start)  # the edge loads the keys before it serves
    url = f"{pipeline.url}/v1/chat/completions"

    async def call(session: aiohttp.ClientSession, key: str, ttft: float,
                   stream: bool = False) -> tuple[int, str, float]:
        body = {"model": "fake", "max_tokens": 3, "stream": stream, "fake_ttft": ttft,
                "messages": [{"role": "user", "content": "q"}]}
        async with session.post(url, json=body,
                                headers={"Authorization": f"Bearer {key}"}) as resp:
            return resp.status, await resp.text(), time.monotonic()

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        # 1. A slow backend (TTFT 0.4 s against a 0.2 s P99 target) for a few
        #    windows: the model enters queue mode.
        stop_load = asyncio.Event()

        async def slow_load() -> None:
            while not stop_load.is_set():
                await asyncio.gather(*(call(session, key_a, 0.4) for _ in range(3)))

        load = asyncio.create_task(slow_load())
        took = await wait_mode(redis_url, pipeline, "queue", within=15)
        stop_load.set()
        await load
        state = await mode_of(redis_url, pipeline)
        print(f"entered queue mode after {took:.1f}s: {state}")
        # The limit is the concurrency a healthy window handled: at most the
        # load's 3 (had the warm-up's window seen some of it), at least the floor.
        # (Causality, not wall-clock alignment of the load to a window.)
        assert QUEUE["min_concurrency"] <= int(state["limit"]) <= 3, state
        limit = int(state["limit"])

        # 2. Two tenants each send a backlog, tenant A first. Round robin must
        #    share the (limited) capacity; the TTL expires the tail.
        watcher = asyncio.create_task(call(session, key_b, 0.3, stream=True))
        backlog_a = [asyncio.create_task(call(session, key_a, 0.3)) for _ in range(BACKLOG)]
        # Tenant A's backlog is queued first (seen in the queue), then B's.
        await eventually(lambda: queued(redis_url, pipeline, BACKLOG - limit - 1), 15.0,
                         "tenant A's backlog queued")
        backlog_b = [asyncio.create_task(call(session, key_b, 0.3)) for _ in range(BACKLOG)]
        results = await asyncio.gather(*backlog_a, *backlog_b)
        _, streamed_text, _ = await watcher

        done = sorted((t, i < BACKLOG) for i, (s, _, t) in enumerate(results) if s == 200)
        expired = [text for s, text, _ in results if s != 200]
        # Fairness while both tenants are backlogged: every completion counts
        # until one tenant's backlog is used up (by completion or expiry).
        both = done[:2 * min(sum(1 for _, a in done if a), sum(1 for _, a in done if not a))]
        share_a = sum(1 for _, is_a in both if is_a) / max(1, len(both))
        print(f"completed {len(done)}, expired {len(expired)}; tenant A share of "
              f"{len(both)} completions while both waited: {share_a:.0%}")
        assert len(done) >= 24, f"too few completions to judge fairness: {len(done)}"
        # Round robin: A is ahead by at most the few it got before B arrived.
        a_first = sum(1 for _, is_a in done[:len(done) // 2] if is_a) / (len(done) // 2)
        assert 0.35 <= a_first <= 0.65, f"A got {a_first:.0%} of the first half"
        assert 0.4 <= share_a <= 0.6, "a backlogged tenant starved the other"
        assert expired, f"with an {QUEUE['ttl']:g} s TTL, part of the backlog must expire"
        assert all('"queue_timeout"' in text or '"queue_full"' in text for text in expired)
        assert any('"queue_timeout"' in text for text in expired)
        # The streaming client queued behind the backlog got its position.
        assert ": queued position=" in streamed_text, streamed_text[:300]

        # 3. The backend recovers: fast answers for a couple of windows and the
        #    model leaves queue mode.
        stop_load.clear()

        async def fast_load() -> None:
            while not stop_load.is_set():
                await asyncio.gather(*(call(session, key_a, 0.01) for _ in range(2)))

        load = asyncio.create_task(fast_load())
        took = await wait_mode(redis_url, pipeline, "normal", within=15)
        stop_load.set()
        await load
        print(f"left queue mode after {took:.1f}s")
        status, _, _ = await call(session, key_b, 0.01)
        assert status == 200
