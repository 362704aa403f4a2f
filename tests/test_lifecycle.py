"""Stream lifecycle against real servers: slow clients, vanished clients, dead
workers, dead edges, drain. A fake backend records how many bytes it managed
to write and when it saw its connection closed.

Each test gets its own subject prefix, so the streams of one test (with jobs
left behind by killed processes) never reach the next.
"""

from __future__ import annotations

import asyncio
import json
import socket
import statistics
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from bench.fake_backend import FakeBackend
from tests.pipeline import (
    DEV_KEY,
    Pipeline,
    jobs_waiting,
    record_for,
    threaded_fake_backend,
    tombstones,
    usage_of,
    wait_for,
    wait_log,
)
from tests.poll import eventually

pytestmark = pytest.mark.pipeline

HEARTBEAT = 1.0


@pytest.fixture(scope="module")
def backend() -> Iterator[FakeBackend]:
    # A model with no natural end: max_tokens decides every length.
    with threaded_fake_backend(models=["fake"], ttft=0.01, itl=0.01, tokens=10**9) as fake:
        yield fake


def make_pipeline(tmp_path: Path, nats_url: str, redis_url: str, backend: FakeBackend,
                  workers: int = 1, **sections: dict[str, Any]) -> Pipeline:
    overrides: dict[str, Any] = {
        "nats": {"subject_prefix": "t" + uuid.uuid4().hex[:8]},
        "session": {"heartbeat_interval": HEARTBEAT, "worker_lost_after": 4,
                    "ack_timeout": 6.0},
        "worker": {"ack_wait": 2.0, "shutdown_timeout": 3.0, "resume_timeout": 2.0},
        "edge": {"shutdown_timeout": 4.0, "slow_client_timeout": 4.0},
        "models": [{"name": "fake", "backend": "openai", "base_url": backend.base_url,
                    "max_streams": 256}],
    }
    for section, values in sections.items():
        overrides.setdefault(section, {}).update(values)
    pipeline = Pipeline(tmp_path, nats_url, redis_url, overrides=overrides, workers=workers)
    pipeline.start()
    return pipeline


@pytest.fixture
def pipelines(tmp_path: Path, module_nats_url: str, module_redis_url: str,
              backend: FakeBackend) -> Iterator[Any]:
    started: list[Pipeline] = []

    def start(workers: int = 1, fake: FakeBackend | None = None,
              **sections: dict[str, Any]) -> Pipeline:
        p = make_pipeline(tmp_path / f"p{len(started)}", module_nats_url, module_redis_url,
                          fake or backend, workers, **sections)
        started.append(p)
        return p

    yield start
    for p in started:
        p.stop()


def body(marker: str, **extra: Any) -> dict[str, Any]:
    return {"model": "fake", "stream": True,
            "messages": [{"role": "user", "content": marker}], **extra}


async def read_events(resp: aiohttp.ClientResponse, limit: int | None = None,
                      ) -> list[str]:
    """SSE data payloads, in order; stops after ``limit`` events if given."""
    events: list[str] = []
    async for line in resp.content:
        if line.startswith(b"data: "):
            events.append(line[6:].decode().strip())
            if limit is not None and len(events) >= limit:
                break
    return events


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmRSS for {pid}")


# ---------------------------------------------------------------------------


async def test_client_disconnect_closes_the_backend_quickly(
        pipelines: Any, backend: FakeBackend) -> None:
    pipeline = pipelines()
    n = 20
    markers = [f"disconnect-{uuid.uuid4().hex}" for _ in range(n)]
    closed_at: dict[str, float] = {}
    async with aiohttp.ClientSession() as session:

        async def one(marker: str) -> None:
            resp = await session.post(
                f"{pipeline.url}/v1/chat/completions",
                json=body(marker, max_tokens=5000, fake_itl=0.01),
                headers={"Authorization": f"Bearer {DEV_KEY}"})
            await read_events(resp, limit=3)
            resp.connection.transport.abort()  # type: ignore[union-attr]
            closed_at[marker] = time.monotonic()
            resp.close()

        await asyncio.gather(*(one(m) for m in markers))
        # Each answer would run 50 s (5,000 tokens at 10 ms): closed well
        # before that is the cancel's doing, whatever this machine's speed.
        assert await wait_for(
            lambda: all(record_for(backend, m) and record_for(backend, m)[0].closed_at
                        for m in markers), 40.0), "backend connections were not closed"
    latencies = sorted(record_for(backend, m)[0].closed_at - closed_at[m]  # type: ignore[operator]
                       for m in markers)
    print(f"cancel latency over {n}: p50 {statistics.median(latencies) * 1000:.1f} ms, "
          f"max {latencies[-1] * 1000:.1f} ms")
    # The target (p99 < 100 ms at 200 streams) is measured by the benchmark
    # suite; here: the backend is closed instead of running its 50 s on, the
    # bound being that 50 s (halved), not a guess at a busy machine's speed.
    assert latencies[-1] < 5000 * 0.01 / 2
    for m in markers:
        assert not record_for(backend, m)[0].completed


@pytest.mark.slow  # 30 s of a client reading nothing
async def test_slow_client_memory_and_backend_bytes_stay_bounded(pipelines: Any) -> None:
    """A client reads nothing for 30 s of a response far larger than the window:
    the backend can write only what fits in the window plus socket buffers,
    and neither edge nor worker grows."""
    total = 50_000 * 4096  # ~200 MB the backend would send if nothing pushed back
    with threaded_fake_backend(models=["fake"], ttft=0.0, itl=0.0, tokens=50_000,
                               token_size=4096) as big:
        pipeline = pipelines(fake=big, edge={"slow_client_timeout": 120.0},
                             session={"ack_timeout": 150.0, "heartbeat_interval": 40.0,
                                      "worker_lost_after": 4},
                             worker={"ack_wait": 60.0})
        edge_pid, worker_pid = pipeline.edge.pid, pipeline.workers[0].pid
        assert edge_pid
        assert worker_pid
        marker = f"slow-{uuid.uuid4().hex}"
        rss_before = (rss_kib(edge_pid), rss_kib(worker_pid))
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", pipeline.port))
        payload = json.dumps(body(marker, max_tokens=50_000)).encode()
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                     b"Authorization: Bearer " + DEV_KEY.encode() + b"\r\n"
                     b"Content-Type: application/json\r\n"
                     b"Content-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload)
        try:
            assert await wait_for(lambda: bool(record_for(big, marker)), 10.0)
            record = record_for(big, marker)[0]
            await asyncio.sleep(30)  # the client reads nothing
            written = record.bytes_written
            rss_after = (rss_kib(edge_pid), rss_kib(worker_pid))
            await asyncio.sleep(1)
            assert record.bytes_written - written < 1 << 20, "backend still writing freely"
        finally:
            sock.close()
    print(f"backend wrote {written / 2**20:.1f} MiB of {total / 2**20:.0f} MiB; "
          f"rss edge {rss_before[0]}->{rss_after[0]} KiB, "
          f"worker {rss_before[1]}->{rss_after[1]} KiB")
    # Window (64 KiB) + the kernel socket buffers on the four loopback legs
    # (each can autotune to a few MiB) + one read in the worker.
    assert written < 24 << 20, f"backend wrote {written} bytes: not pushed back"
    assert written < total / 8
    assert rss_after[0] - rss_before[0] < 10 * 1024, "edge RSS grew by 10 MB or more"
    assert rss_after[1] - rss_before[1] < 10 * 1024, "worker RSS grew by 10 MB or more"


async def test_slow_client_is_disconnected_and_cancelled(pipelines: Any,
                                                         backend: FakeBackend) -> None:
    pipeline = pipelines(edge={"slow_client_timeout": 2.0})
    marker = f"stuck-{uuid.uuid4().hex}"
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", pipeline.port))
    payload = json.dumps(body(marker, max_tokens=200_000, fake_itl=0.0)).encode()
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                 b"Authorization: Bearer " + DEV_KEY.encode() + b"\r\n"
                 b"Content-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload)
    try:
        assert await wait_for(lambda: bool(record_for(backend, marker)), 10.0)
        record = record_for(backend, marker)[0]
        # Window full and the socket not draining: the edge gives up after
        # 2 s, cancels, and the worker closes the backend response.
        assert await wait_for(lambda: record.closed_at is not None, 10.0), \
            "backend connection never closed for a stuck client"
        assert not record.completed
    finally:
        sock.close()


async def test_worker_killed_mid_stream_gives_retryable_error_and_no_rerun(
        pipelines: Any, backend: FakeBackend) -> None:
    pipeline = pipelines()
    marker = f"midstream-{uuid.uuid4().hex}"
    async with aiohttp.ClientSession() as session:
        resp = await session.post(f"{pipeline.url}/v1/chat/completions",
                                  json=body(marker, max_tokens=3000, fake_itl=0.01),
                                  headers={"Authorization": f"Bearer {DEV_KEY}"})
        assert resp.status == 200
        request_id = resp.headers["x-request-id"]
        first = await read_events(resp, limit=5)
        pipeline.workers[0].kill()
        killed = time.monotonic()
        rest = await asyncio.wait_for(read_events(resp), 30)
        ended = time.monotonic()
    events = first + rest
    error = json.loads(events[-1])["error"]
    assert error["code"] == "worker_lost"
    assert error["retryable"] is True
    assert "[DONE]" not in events
    lost_after = HEARTBEAT * 4
    assert ended - killed < lost_after + 1.5, f"error took {ended - killed:.1f}s"
    # A restarted worker gets the redelivered job, but must not run it again:
    # its usage record (the killed attempt left none) shows it pulled the job
    # and dropped it, and the backend saw one call only.
    await asyncio.to_thread(pipeline.workers[0].spawn)
    [record] = await usage_of(pipeline.config, request_id, within=30)
    assert record.attempt >= 2, record
    assert record.outcome == "dropped", record
    assert (record.prompt_tokens, record.completion_tokens) == (0, 0)
    assert len(record_for(backend, marker)) == 1, "the job ran twice"


async def test_worker_killed_before_first_chunk_completes_elsewhere(
        pipelines: Any, backend: FakeBackend) -> None:
    pipeline = pipelines(workers=1)
    marker = f"prefill-{uuid.uuid4().hex}"
    async with aiohttp.ClientSession() as session:
        request = asyncio.ensure_future(session.post(
            f"{pipeline.url}/v1/chat/completions",
            # A long prefill: starting a second worker on a loaded box takes
            # seconds, and the first must still be in it when it is killed.
            json=body(marker, max_tokens=8, fake_ttft=10.0),
            headers={"Authorization": f"Bearer {DEV_KEY}"}))
        assert await wait_for(lambda: bool(record_for(backend, marker)), 10.0)
        # The first worker is in the backend's prefill. Start a second one,
        # then kill the first before any chunk exists.
        second = pipeline._process("worker", "worker-b")
        pipeline.workers.append(second)
        await asyncio.to_thread(second.spawn)
        await wait_log(second, "worker serving fake")  # it pulls from now on
        assert not record_for(backend, marker)[0].bytes_written, "still in prefill"
        pipeline.workers[0].kill()
        resp = await asyncio.wait_for(request, 90)
        assert resp.status == 200, await resp.text()
        events = await asyncio.wait_for(read_events(resp), 30)
    assert events[-1] == "[DONE]"
    content = "".join(json.loads(e)["choices"][0]["delta"].get("content") or ""
                      for e in events[:-1] if json.loads(e)["choices"])
    assert content
    records = record_for(backend, marker)
    assert len(records) == 2, "the redelivered job should have run on the second worker"
    assert records[0].closed_at is not None
    assert not records[0].completed
    assert records[1].completed


async def test_edge_killed_worker_cancels_backend_within_ack_timeout(
        pipelines: Any, backend: FakeBackend) -> None:
    ack_timeout = 3.0
    pipeline = pipelines(session={"ack_timeout": ack_timeout},
                         edge={"slow_client_timeout": 2.0})
    marker = f"edgedeath-{uuid.uuid4().hex}"
    async with aiohttp.ClientSession() as session:
        resp = await session.post(f"{pipeline.url}/v1/chat/completions",
                                  json=body(marker, max_tokens=5000, fake_itl=0.02),
                                  headers={"Authorization": f"Bearer {DEV_KEY}"})
        await read_events(resp, limit=3)
        pipeline.edge.kill()
        killed = time.monotonic()
        resp.close()
    record = record_for(backend, marker)[0]
    # The edge acked at most ack_timeout/4 before dying; the worker checks
    # every ack_timeout/4.
    assert await wait_for(lambda: record.closed_at is not None, ack_timeout + 5.0), \
        "the worker never cancelled the backend of a dead edge"
    assert record.closed_at is not None
    assert record.closed_at - killed < ack_timeout + ack_timeout / 2 + 0.5
    assert not record.completed


async def test_edge_drain_finishes_short_streams_and_ends_long_ones(
        pipelines: Any, backend: FakeBackend) -> None:
    pipeline = pipelines(edge={"shutdown_timeout": 3.0})
    short, long = f"short-{uuid.uuid4().hex}", f"long-{uuid.uuid4().hex}"
    async with aiohttp.ClientSession() as session:
        headers = {"Authorization": f"Bearer {DEV_KEY}"}
        short_resp = await session.post(f"{pipeline.url}/v1/chat/completions",
                                        json=body(short, max_tokens=100, fake_itl=0.01),
                                        headers=headers)
        long_resp = await session.post(f"{pipeline.url}/v1/chat/completions",
                                       json=body(long, max_tokens=3000, fake_itl=0.01),
                                       headers=headers)
        pipeline.edge.terminate()  # SIGTERM

        async def refused() -> bool:
            try:
                async with aiohttp.ClientSession() as fresh:
                    await fresh.post(f"{pipeline.url}/v1/chat/completions",
                                     json=body("late", max_tokens=1), headers=headers)
            except aiohttp.ClientConnectionError:
                return True
            return False

        await eventually(refused, 10.0, "the draining edge refuses new connections",
                         step=0.05)
        short_events = await asyncio.wait_for(read_events(short_resp), 15)
        long_events = await asyncio.wait_for(read_events(long_resp), 15)
    assert short_events[-1] == "[DONE]", "a stream that fits the drain deadline must finish"
    error = json.loads(long_events[-1])["error"]
    assert error["code"] == "edge_shutting_down"
    assert error["retryable"] is True
    assert pipeline.edge.wait(10) == 0
    record = record_for(backend, long)[0]
    assert await wait_for(lambda: record.closed_at is not None, 5.0), \
        "the long stream's backend work was not cancelled"


async def test_cancel_while_queued_stops_the_job_before_it_runs(
        tmp_path: Path, module_nats_url: str, module_redis_url: str,
        backend: FakeBackend) -> None:
    """A client that leaves while its request waits for a worker: the edge has
    no worker to tell directly, so the tombstone is the only cancel, and the
    worker that later pulls the job must drop it without calling the backend."""
    overrides: dict[str, Any] = {
        "nats": {"subject_prefix": "t" + uuid.uuid4().hex[:8]},
        "session": {"heartbeat_interval": HEARTBEAT, "worker_lost_after": 4,
                    "ack_timeout": 6.0},
        "worker": {"ack_wait": 2.0, "shutdown_timeout": 3.0, "resume_timeout": 2.0},
        "models": [{"name": "fake", "backend": "openai", "base_url": backend.base_url,
                    "max_streams": 8}],
    }
    pipeline = Pipeline(tmp_path, module_nats_url, module_redis_url, overrides=overrides,
                        workers=1)
    pipeline.dispatcher.spawn()
    pipeline.edge.start()  # no worker yet: the job waits in TG_JOBS
    try:
        gone, kept = f"queued-gone-{uuid.uuid4().hex}", f"queued-kept-{uuid.uuid4().hex}"
        async with aiohttp.ClientSession() as session:
            async def post(marker: str) -> list[str]:
                async with session.post(f"{pipeline.url}/v1/chat/completions",
                                        json=body(marker, max_tokens=3),
                                        headers={"Authorization": f"Bearer {DEV_KEY}"}) as resp:
                    return await read_events(resp)

            leaver = asyncio.create_task(post(gone))
            # Admitted: its job waits in TG_JOBS. Then the client hangs up.
            await eventually(lambda: jobs_waiting(pipeline, 1), 15.0, "the job is queued")
            leaver.cancel()
            with pytest.raises(asyncio.CancelledError):
                await leaver
            await eventually(lambda: tombstones(pipeline, 1), 10.0, "the tombstone is written")
            pipeline.workers[0].spawn()
            # A request sent after the worker is up completes: the worker is
            # pulling, so the cancelled job was pulled (it was first in line).
            events = await asyncio.wait_for(post(kept), 20.0)
            assert events[-1] == "[DONE]"
            # The worker pulled the cancelled job and dropped it (its record).
            gone_id = (await eventually(lambda: tombstones(pipeline, 1), 1.0, "tombstone"))[0]
            [dropped] = await usage_of(pipeline.config, gone_id, within=15)
            assert dropped.outcome == "dropped", dropped
        assert record_for(backend, kept)
        assert not record_for(backend, gone), "a cancelled queued job reached the backend"
    finally:
        pipeline.stop()


async def test_edge_does_not_hold_prompts_of_open_streams(pipelines: Any) -> None:
    """Once a request is published the edge needs its id and window, not its
    prompt: 40 open streams with 400 KB prompts must not grow the edge by the
    prompts (they would be 16 MB as bytes and as much again parsed)."""
    pipeline = pipelines()
    n, prompt = 40, "p" * 400_000
    async with aiohttp.ClientSession() as session:
        baseline = rss_kib(pipeline.edge.pid)  # type: ignore[arg-type]

        async def open_stream(i: int) -> aiohttp.ClientResponse:
            resp = await session.post(
                f"{pipeline.url}/v1/chat/completions",
                json={"model": "fake", "stream": True, "max_tokens": 1, "fake_ttft": 60,
                      "messages": [{"role": "user", "content": f"{i} {prompt}"}]},
                headers={"Authorization": f"Bearer {DEV_KEY}"})
            assert resp.status == 200  # headers went out with the first ping
            return resp

        # One at a time, so what a request needs only while it is published
        # is freed (and reused by the allocator) before the next arrives:
        # what stays is what the edge holds per open stream.
        tasks = []
        for i in range(n):
            tasks.append(asyncio.create_task(open_stream(i)))
            await asyncio.sleep(0.05)
        responses = await asyncio.gather(*tasks)
        held = rss_kib(pipeline.edge.pid)  # type: ignore[arg-type]
        for resp in responses:
            resp.close()
    grown_mib = (held - baseline) / 1024
    print(f"edge RSS grew {grown_mib:.1f} MiB for {n} open streams with "
          f"{len(prompt) // 1000} KB prompts")
    assert grown_mib < 8, f"the edge holds the prompts of open streams ({grown_mib:.1f} MiB)"
