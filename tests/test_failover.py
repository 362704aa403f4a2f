"""Fast death detection (issue 25, item 1) against real servers.

The edge probes each worker its streams follow (tidegate.broker.liveness): a worker whose
NATS connection is gone (SIGKILL) is known dead within about
``session.liveness_interval``; a job with no output yet is handed back to
JetStream at once and runs on another worker; a stream with output ends with
``worker_lost`` at once instead of at the heartbeat limit. A worker that is
only slow (stopped for seconds) is not declared dead.

The heartbeat limit and ``worker.ack_wait`` are set far above what the tests
wait for, so a test that passes cannot have been saved by them.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import statistics
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import nats
import pytest

from bench.fake_backend import FakeBackend
from tests.pipeline import (
    DEV_KEY,
    Pipeline,
    record_for,
    threaded_fake_backend,
)
from tests.poll import eventually
from tidegate.broker.liveness import WorkerWatch

HEARTBEAT = 1.0
LOST_AFTER = 40  # heartbeats: 40 s, far above anything these tests wait for
ACK_WAIT = 30.0  # JetStream redelivery of a dead worker's job, also far above


@pytest.fixture(scope="module")
def backend() -> Iterator[FakeBackend]:
    with threaded_fake_backend(models=["fake"], ttft=0.01, itl=0.01, tokens=10**9) as fake:
        yield fake


def start_pipeline(tmp_path: Path, nats_url: str, redis_url: str, backend: FakeBackend,
                   workers: int, liveness: float = 0.25) -> Pipeline:
    overrides: dict[str, Any] = {
        "nats": {"subject_prefix": "f" + uuid.uuid4().hex[:8]},
        "session": {"heartbeat_interval": HEARTBEAT, "worker_lost_after": LOST_AFTER,
                    "ack_timeout": 60.0, "liveness_interval": liveness},
        "worker": {"ack_wait": ACK_WAIT, "shutdown_timeout": 3.0, "resume_timeout": 5.0},
        "edge": {"shutdown_timeout": 4.0, "slow_client_timeout": 30.0,
                 "request_timeout": 300.0},
        "models": [{"name": "fake", "backend": "openai", "base_url": backend.base_url,
                    "max_streams": 256}],
    }
    pipeline = Pipeline(tmp_path, nats_url, redis_url, overrides=overrides, workers=workers)
    pipeline.start()
    return pipeline


@pytest.fixture
def pipelines(tmp_path: Path, module_nats_url: str, module_redis_url: str,
              backend: FakeBackend) -> Iterator[Any]:
    started: list[Pipeline] = []

    def start(workers: int = 2, liveness: float = 0.25) -> Pipeline:
        p = start_pipeline(tmp_path / f"p{len(started)}", module_nats_url, module_redis_url,
                           backend, workers, liveness)
        started.append(p)
        return p

    yield start
    for p in started:
        p.stop()


def body(marker: str, **extra: Any) -> dict[str, Any]:
    return {"model": "fake", "stream": True,
            "messages": [{"role": "user", "content": marker}], **extra}


async def stream(session: aiohttp.ClientSession, url: str, payload: dict[str, Any],
                 events: list[str], ended: dict[str, float]) -> None:
    """One streaming request; appends its data payloads, notes when it ended."""
    async with session.post(f"{url}/v1/chat/completions", json=payload,
                            headers={"Authorization": f"Bearer {DEV_KEY}"}) as resp:
        assert resp.status == 200, await resp.text()
        async for line in resp.content:
            if line.startswith(b"data: "):
                events.append(line[6:].decode().strip())
    ended[payload["messages"][0]["content"]] = time.monotonic()


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]


# -- the probe on its own, against a real nats-server -----------------------------


async def test_watch_tells_a_closed_connection_from_a_live_one(nats_server: Any) -> None:
    """Two "workers" subscribe to their control subjects; one closes its
    connection. Only its follower hears of it; the live one never does,
    although it answers no probe (a timeout means alive)."""
    dead = await nats.connect(nats_server.url)
    live = await nats.connect(nats_server.url)
    edge = await nats.connect(nats_server.url)
    await dead.subscribe("tg.ctl.dead", cb=_ignore)
    await live.subscribe("tg.ctl.live", cb=_ignore)
    await dead.flush()
    await live.flush()
    lost: dict[str, float] = {}

    class Follower:
        def __init__(self, name: str) -> None:
            self.name = name

        def worker_lost(self, control: str) -> None:
            lost[self.name] = time.monotonic()

    watch = WorkerWatch(edge, 0.1)
    watch.follow(Follower("dead"), "tg.ctl.dead")
    watch.follow(Follower("live"), "tg.ctl.live")
    try:
        await asyncio.sleep(0.5)
        assert not lost, "a subscribed worker was declared dead"
        await dead.close()
        closed = time.monotonic()
        await eventually(lambda: "dead" in lost, 30, "the closed worker declared dead")
        await asyncio.sleep(1.0)
        assert "live" not in lost, "the live worker was declared dead"
        assert watch.following() == ["tg.ctl.live"]
        print(f"detected in {lost['dead'] - closed:.3f}s")
    finally:
        watch.close()
        await live.close()
        await edge.close()


async def _ignore(msg: Any) -> None:
    return None


# -- the pipeline: SIGKILL, SIGSTOP ------------------------------------------------


@pytest.mark.slow
@pytest.mark.pipeline
async def test_worker_killed_before_first_chunk_runs_elsewhere_at_once(
        pipelines: Any, backend: FakeBackend) -> None:
    """12 streams in a 3 s prefill over two workers; one worker is SIGKILLed.
    Every stream completes; those of the dead worker ran again on the other,
    long before worker.ack_wait (30 s) would have redelivered them."""
    pipeline = pipelines(workers=2)
    prefill = 3.0
    markers = [f"pre-{i}-{uuid.uuid4().hex}" for i in range(12)]
    events: dict[str, list[str]] = {m: [] for m in markers}
    ended: dict[str, float] = {}
    async with aiohttp.ClientSession() as session:
        tasks = [asyncio.ensure_future(stream(session, pipeline.url,
                                              body(m, max_tokens=8, fake_ttft=prefill),
                                              events[m], ended)) for m in markers]
        await eventually(lambda: all(record_for(backend, m) for m in markers), 30,
                         "every request in its prefill")
        pipeline.workers[0].kill()
        killed = time.monotonic()
        await asyncio.wait_for(asyncio.gather(*tasks), 60)
    restarted = [m for m in markers if len(record_for(backend, m)) == 2]
    assert restarted, "no stream ran on the killed worker"
    for m in markers:
        assert events[m][-1] == "[DONE]", (m, events[m][-3:])
    # A restarted job runs its prefill again after the kill: without the
    # probe it would wait for ack_wait first.
    late = [ended[m] - killed for m in restarted]
    print(f"restarted {len(restarted)}: done {min(late):.2f}..{max(late):.2f}s after the kill "
          f"(prefill {prefill}s)")
    assert max(late) < ACK_WAIT - 5, late
    gaps = [record_for(backend, m)[1].started_at - killed for m in restarted]
    print(f"restarted on the other worker {statistics.median(gaps):.3f}s (median), "
          f"{p99(gaps):.3f}s (p99) after the kill")


@pytest.mark.slow
@pytest.mark.pipeline
async def test_worker_killed_mid_stream_is_known_within_a_second(
        pipelines: Any, backend: FakeBackend) -> None:
    """30 streams over two workers, one SIGKILLed mid-stream: its streams end
    with the retryable worker_lost at once (the heartbeat limit is 40 s), the
    others complete."""
    pipeline = pipelines(workers=2)
    markers = [f"mid-{i}-{uuid.uuid4().hex}" for i in range(30)]
    events: dict[str, list[str]] = {m: [] for m in markers}
    ended: dict[str, float] = {}
    async with aiohttp.ClientSession() as session:
        tasks = [asyncio.ensure_future(stream(session, pipeline.url,
                                              body(m, max_tokens=600, fake_itl=0.01),
                                              events[m], ended)) for m in markers]
        await eventually(lambda: all(len(events[m]) >= 3 for m in markers), 30,
                         "every stream flowing")
        pipeline.workers[0].kill()
        killed = time.monotonic()
        await asyncio.wait_for(asyncio.gather(*tasks), 60)
    lost = [m for m in markers if events[m][-1] != "[DONE]"]
    assert lost, "no stream ran on the killed worker"
    for m in lost:
        error = json.loads(events[m][-1])["error"]
        assert (error["code"], error["retryable"]) == ("worker_lost", True), error
    delays = [ended[m] - killed for m in lost]
    print(f"{len(lost)} streams lost their worker; told after p50 "
          f"{statistics.median(delays):.3f}s, p99 {p99(delays):.3f}s, max {max(delays):.3f}s")
    assert max(delays) < HEARTBEAT * LOST_AFTER / 4, delays


@pytest.mark.slow
@pytest.mark.pipeline
async def test_a_stopped_worker_is_slow_not_dead(pipelines: Any, backend: FakeBackend) -> None:
    """SIGSTOP of the only worker for 4 s mid-stream, then SIGCONT: the stream
    goes on and completes, with one backend call; a probe that took silence
    for death would have ended it with worker_lost."""
    pipeline = pipelines(workers=1, liveness=0.1)
    marker = f"slow-{uuid.uuid4().hex}"
    events: list[str] = []
    ended: dict[str, float] = {}
    worker = pipeline.workers[0]
    assert worker.pid is not None
    async with aiohttp.ClientSession() as session:
        task = asyncio.ensure_future(stream(session, pipeline.url,
                                            body(marker, max_tokens=400, fake_itl=0.01),
                                            events, ended))
        await eventually(lambda: len(events) >= 3, 30, "the stream flowing")
        os.kill(worker.pid, signal.SIGSTOP)
        try:
            await asyncio.sleep(4.0)
            assert not task.done(), events[-1:]
        finally:
            os.kill(worker.pid, signal.SIGCONT)
        await asyncio.wait_for(task, 60)
    assert events[-1] == "[DONE]", events[-3:]
    assert len(record_for(backend, marker)) == 1
    assert "is gone" not in pipeline.edge.log_path.read_text()
