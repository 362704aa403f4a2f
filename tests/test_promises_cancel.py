"""The edge's direct ``Cancel`` to the worker, on its own (issue 26).

docs/architecture.md: a client that disconnects makes its edge publish a
``Cancel`` to the worker's control subject (the fast path: the worker closes
the backend response at once) and a tombstone in ``<P>_CANCELS`` (the safety
net for a request no worker holds yet). Every other cancel test passes on the
tombstone alone, so this one takes it away: the cancels bucket's stream is
sealed before the request, so the tombstone is never stored and never
reaches the worker's watch. The worker's own fallback, the ack timeout, is
set far beyond the test's wait. What closes the backend response then is the
direct ``Cancel`` and nothing else (seen failing with that publish removed
from ``edge/relay.py``).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import nats
import pytest
from nats.js.api import StreamConfig

from bench.fake_backend import FakeBackend
from tests.pipeline import DEV_KEY, Pipeline, record_for, threaded_fake_backend
from tests.poll import eventually

pytestmark = pytest.mark.pipeline

AUTH = {"Authorization": f"Bearer {DEV_KEY}"}
ACK_TIMEOUT = 600.0  # the worker's own fallback: far past the wait below


@pytest.fixture
def backend() -> Iterator[FakeBackend]:
    with threaded_fake_backend(models=["fake"], ttft=0.01, itl=0.005, tokens=10**9) as fake:
        yield fake


@pytest.fixture
def pipeline(tmp_path: Path, module_nats_url: str, module_redis_url: str,
             backend: FakeBackend) -> Iterator[Pipeline]:
    p = Pipeline(tmp_path, module_nats_url, module_redis_url, overrides={
        "nats": {"subject_prefix": "c" + uuid.uuid4().hex[:8]},
        "session": {"ack_timeout": ACK_TIMEOUT},
        "models": [{"name": "fake", "backend": "openai", "base_url": backend.base_url,
                    "max_streams": 8}]})
    try:
        p.start()
        yield p
    finally:
        p.stop()


async def seal_tombstones(pipeline: Pipeline) -> None:
    """From now on no tombstone is stored: a sealed stream takes no message."""
    nc = await nats.connect(pipeline.config.nats.url)
    try:
        js = nc.jetstream()
        name = f"KV_{pipeline.config.nats.subjects.cancels_bucket}"
        config = (await js.stream_info(name)).config
        await js.update_stream(StreamConfig.from_response({**config.as_dict(), "sealed": True}))
        assert (await js.stream_info(name)).config.sealed
    finally:
        await nc.close()


async def test_a_disconnect_cancels_the_running_job_by_the_direct_cancel_alone(
        pipeline: Pipeline, backend: FakeBackend) -> None:
    await seal_tombstones(pipeline)
    marker = f"direct-{uuid.uuid4().hex}"
    body = {"model": "fake", "stream": True, "max_tokens": 200_000,
            "messages": [{"role": "user", "content": marker}]}
    async with aiohttp.ClientSession() as session:
        resp = await session.post(f"{pipeline.base_url}/chat/completions", json=body,
                                  headers=AUTH)
        assert resp.status == 200
        chunks = 0
        async for line in resp.content:
            chunks += line.startswith(b"data: ")
            if chunks == 5:
                break
        resp.connection.transport.abort()  # type: ignore[union-attr]
        resp.close()
    (record,) = record_for(backend, marker)
    await eventually(lambda: record.closed_at is not None, ACK_TIMEOUT / 4,
                     "the worker closed the backend response after the disconnect")
    assert not record.completed
    # Nothing came through the tombstone path: the bucket stayed empty.
    nc = await nats.connect(pipeline.config.nats.url)
    try:
        name = f"KV_{pipeline.config.nats.subjects.cancels_bucket}"
        assert (await nc.jetstream().stream_info(name)).state.messages == 0
    finally:
        await nc.close()
