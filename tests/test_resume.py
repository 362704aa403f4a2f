"""Resumable streams against real servers: two edges, the stream log in
JetStream, explicit cancel, grace, tenant isolation (docs/resume.md).

Byte-exactness is checked against the stream's own full replay
(``GET /v1/streams/{id}?after=0`` once it has ended) and against what the
fake backend wrote: what a client got across connections, event by event,
is what one uninterrupted connection gets, and what the backend produced.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from bench.fake_backend import FakeBackend
from tests.pipeline import DEV_KEY, Pipeline, record_for, threaded_fake_backend, wait_for

pytestmark = pytest.mark.pipeline

AUTH = {"Authorization": f"Bearer {DEV_KEY}"}
RESUMABLE = {**AUTH, "X-Tidegate-Resumable": "true"}


# A cancelled 5,000-token stream (10 ms a token) would run 50 s more: the
# backend closed well before that is the cancel's doing. The bound is half the
# run the cancel saved, not a guess at how fast a busy machine is.
CANCEL_BOUND = 5000 * 0.01 / 2


@pytest.fixture(scope="module")
def backend() -> Iterator[FakeBackend]:
    with threaded_fake_backend(models=["fake"], ttft=0.01, itl=0.01, tokens=10**9,
                                keep_output=True) as fake:
        yield fake


@pytest.fixture
def pipelines(tmp_path: Path, module_nats_url: str, module_redis_url: str,
              backend: FakeBackend) -> Iterator[Any]:
    started: list[Pipeline] = []

    def start(edges: int = 2, models: list[dict[str, Any]] | None = None,
              **sections: dict[str, Any]) -> Pipeline:
        overrides: dict[str, Any] = {
            "nats": {"subject_prefix": "r" + uuid.uuid4().hex[:8]},
            "session": {"heartbeat_interval": 1.0, "worker_lost_after": 4, "ack_timeout": 6.0},
            "worker": {"ack_wait": 2.0, "shutdown_timeout": 3.0},
            "edge": {"shutdown_timeout": 4.0, "slow_client_timeout": 4.0},
            "resume": {"attach_interval": 0.5},
            "models": [{"name": "fake", "backend": "openai", "base_url": backend.base_url,
                        "max_streams": 64}],
        }
        if models is not None:
            overrides["models"] = models
        for section, values in sections.items():
            overrides.setdefault(section, {}).update(values)
        p = Pipeline(tmp_path / f"p{len(started)}", module_nats_url, module_redis_url,
                     overrides=overrides, edges=edges)
        started.append(p)
        p.start()
        return p

    yield start
    for p in started:
        p.stop()


def body(marker: str, **extra: Any) -> dict[str, Any]:
    # With the usage event, so the client gets every event the backend wrote.
    return {"model": "fake", "stream": True, "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": marker}], **extra}


class Sse:
    """The blocks of one SSE response, as received (each without its blank line)."""

    def __init__(self) -> None:
        self.blocks: list[bytes] = []
        # The ``retry:`` lines, taken out of the blocks they came in (the
        # first event's), so blocks of a stream and of its resume compare.
        self.retries: list[bytes] = []
        self.reconnects = 0  # (follow) how many reconnect events the client followed

    @property
    def events(self) -> list[bytes]:
        """Blocks that carry data (not ``retry:``, ``: ping``, ``[DONE]`` or the
        reconnect event)."""
        return [b for b in self.blocks if b"data: " in b and b != b"data: [DONE]"
                and not b.startswith(b"event: reconnect\n")]

    @property
    def ids(self) -> list[int]:
        return [int(b.split(b"\n", 1)[0][4:]) for b in self.events if b.startswith(b"id: ")]

    @property
    def done(self) -> bool:
        return bool(self.blocks) and self.blocks[-1] == b"data: [DONE]"

    @property
    def last_error(self) -> dict[str, Any] | None:
        for block in reversed(self.events):
            if b'"error"' in block and b"id: " not in block[:4]:
                return dict(json.loads(block.split(b"data: ", 1)[1])["error"])
        return None

    async def read(self, resp: aiohttp.ClientResponse, events: int | None = None) -> Sse:
        current: list[bytes] = []
        async for line in resp.content:
            if line == b"\n":
                self.blocks.append(b"".join(current).rstrip(b"\n"))
                current = []
                if events is not None and len(self.events) >= events:
                    break
            elif line.startswith(b"retry: "):
                self.retries.append(line.rstrip(b"\n"))
            else:
                current.append(line)
        return self


async def replay(session: aiohttp.ClientSession, url: str, request_id: str,
                 after: int = 0, key: str = DEV_KEY) -> Sse:
    resp = await session.get(f"{url}/v1/streams/{request_id}",
                             headers={"Authorization": f"Bearer {key}",
                                      "Last-Event-ID": str(after)})
    assert resp.status == 200, await resp.text()
    assert resp.headers["x-tidegate-resumable"] == "true"
    return await Sse().read(resp)


def payloads(sse: Sse) -> bytes:
    """The events as the backend wrote them: without our ``id:`` lines."""
    out = []
    for block in sse.events:
        out.append(block.split(b"\n", 1)[1] if block.startswith(b"id: ") else block)
    return b"".join(e + b"\n\n" for e in out)


def backend_events(backend: FakeBackend, marker: str) -> bytes:
    (record,) = record_for(backend, marker)
    return bytes(record.output).replace(b"data: [DONE]\n\n", b"")


async def tenant_key(pipeline: Pipeline, tenant: str) -> str:
    """A new API key of ``tenant``, once every edge accepts it."""
    created = await asyncio.to_thread(
        subprocess.run, [sys.executable, "-m", "fleet", "keys", "create", "--tenant", tenant,
                         "--json", "--config", str(pipeline.config_path)],
        capture_output=True, text=True, check=True)
    key = str(json.loads(created.stdout)["key"])
    async with aiohttp.ClientSession() as session:
        for url in pipeline.edge_urls:
            deadline = time.monotonic() + 10
            while True:
                got = await session.get(f"{url}/v1/models",
                                        headers={"Authorization": f"Bearer {key}"})
                if got.status == 200:
                    break
                assert time.monotonic() < deadline, "the new key never reached the edge"
                await asyncio.sleep(0.05)
    return key


def abort(resp: aiohttp.ClientResponse) -> None:
    resp.connection.transport.abort()  # type: ignore[union-attr]
    resp.close()


# ---------------------------------------------------------------------------


async def test_resume_on_another_edge_mid_stream_is_byte_exact(
        pipelines: Any, backend: FakeBackend) -> None:
    pipeline = pipelines()
    a, b = pipeline.edge_urls
    marker = f"resume-{uuid.uuid4().hex}"
    async with aiohttp.ClientSession() as session:
        resp = await session.post(f"{a}/v1/chat/completions",
                                  json=body(marker, max_tokens=300), headers=RESUMABLE)
        assert resp.status == 200
        assert resp.headers["x-tidegate-resumable"] == "true"
        request_id = resp.headers["x-request-id"]
        first = await Sse().read(resp, events=20)
        abort(resp)
        # One retry field, in the first event's block: a block of its own
        # would be an empty event to the openai SDK.
        assert first.retries == [b"retry: 1000"]
        assert first.blocks[0].startswith(b"id: 1\n")
        assert first.ids == list(range(1, 21))

        second = await replay(session, b, request_id, after=first.ids[-1])
        assert second.done
        full = await replay(session, b, request_id)
    assert full.done
    assert first.events + second.events == full.events  # byte for byte, no event twice
    assert full.ids == list(range(1, len(full.events) + 1))
    assert len(full.events) > 300  # one per token, plus the role and finish events
    assert payloads(full) == backend_events(backend, marker)


async def test_resume_after_completion_and_after_the_worker_exited(
        pipelines: Any, backend: FakeBackend) -> None:
    pipeline = pipelines()
    a, b = pipeline.edge_urls
    marker = f"finished-{uuid.uuid4().hex}"
    async with aiohttp.ClientSession() as session:
        resp = await session.post(f"{a}/v1/chat/completions",
                                  json=body(marker, max_tokens=40), headers=RESUMABLE)
        request_id = resp.headers["x-request-id"]
        original = await Sse().read(resp)
        assert original.done
        pipeline.workers[0].stop()
        whole = await replay(session, b, request_id)
        tail = await replay(session, a, request_id, after=30)
        beyond = await replay(session, b, request_id, after=10_000)
    assert whole.events == original.events
    assert tail.events == original.events[30:]
    assert tail.done
    assert beyond.events == []
    assert beyond.done
    assert payloads(whole) == backend_events(backend, marker)


async def test_the_openai_sdk_reads_a_resumable_stream_and_its_resume(
        pipelines: Any, backend: FakeBackend) -> None:
    """The official SDK on a resumable stream, and on its replay from another
    edge: the retry field must not form a block of its own, which the SDK
    reads as an event with empty data (JSONDecodeError)."""
    import openai

    pipeline = pipelines()
    a, b = pipeline.edge_urls
    marker = f"sdk-{uuid.uuid4().hex}"
    async with openai.AsyncOpenAI(base_url=f"{a}/v1", api_key=DEV_KEY, max_retries=0,
                                  default_headers={"X-Tidegate-Resumable": "true"}) as client:
        raw = await client.chat.completions.with_raw_response.create(
            model="fake", stream=True, max_tokens=12,
            messages=[{"role": "user", "content": marker}])
        assert raw.headers["x-tidegate-resumable"] == "true"
        request_id = raw.headers["x-request-id"]
        text = ""
        async for chunk in raw.parse():
            for choice in chunk.choices:
                text += choice.delta.content or ""
    assert text
    # The replay through the SDK's own SSE decoder, on the other edge.
    async with aiohttp.ClientSession() as session, session.get(
            f"{b}/v1/streams/{request_id}", headers=AUTH) as resp:
        assert resp.status == 200
        replayed = ""
        async for sse in openai._streaming.SSEDecoder().aiter_bytes(resp.content.iter_any()):
            if sse.data == "[DONE]":
                break
            for choice in sse.json()["choices"]:
                replayed += choice["delta"].get("content") or ""
    assert replayed == text


async def test_edge_killed_mid_stream_client_resumes_elsewhere(
        pipelines: Any, backend: FakeBackend) -> None:
    # Far more than the credit window (64 KiB): the worker stalls on the dead
    # edge's acks until the resumed reader attaches.
    pipeline = pipelines()
    a, b = pipeline.edge_urls
    marker = f"edgekill-{uuid.uuid4().hex}"
    async with aiohttp.ClientSession() as session:
        resp = await session.post(f"{a}/v1/chat/completions",
                                  json=body(marker, max_tokens=1500, fake_itl=0.001),
                                  headers=RESUMABLE)
        request_id = resp.headers["x-request-id"]
        first = await Sse().read(resp, events=10)
        pipeline.edge.kill()
        resp.close()
        rest = await replay(session, b, request_id, after=first.ids[-1])
        full = await replay(session, b, request_id)
    assert rest.done
    assert first.events + rest.events == full.events
    assert payloads(full) == backend_events(backend, marker)


async def test_other_tenant_gets_404_and_cancel_ends_every_reader(
        pipelines: Any, backend: FakeBackend) -> None:
    pipeline = pipelines()
    a, b = pipeline.edge_urls
    other = await tenant_key(pipeline, "other")
    marker = f"cancel-{uuid.uuid4().hex}"
    async with aiohttp.ClientSession() as session:
        resp = await session.post(f"{a}/v1/chat/completions",
                                  json=body(marker, max_tokens=5000), headers=RESUMABLE)
        request_id = resp.headers["x-request-id"]
        first = await Sse().read(resp, events=3)

        for url in (a, b):
            for rid in (request_id, "0" * 24, "not-an-id"):
                got = await session.get(f"{url}/v1/streams/{rid}",
                                        headers={"Authorization": f"Bearer {other}"})
                assert got.status == 404, (url, rid)
                assert (await got.json())["error"]["code"] == "stream_not_found"
                got = await session.post(f"{url}/v1/streams/{rid}/cancel",
                                         headers={"Authorization": f"Bearer {other}"})
                assert got.status == 404
                assert (await got.json())["error"]["code"] == "stream_not_found"

        reader = await session.get(f"{b}/v1/streams/{request_id}",
                                   headers={**AUTH, "Last-Event-ID": "0"})
        cancelled_at = time.monotonic()
        cancelled = await session.post(f"{b}/v1/streams/{request_id}/cancel", headers=AUTH)
        assert cancelled.status == 200, await cancelled.text()
        again = await session.post(f"{a}/v1/streams/{request_id}/cancel", headers=AUTH)
        assert again.status == 200  # idempotent
        rest = await asyncio.wait_for(first.read(resp), 10)
        other_reader = await asyncio.wait_for(Sse().read(reader), 10)
    for sse in (rest, other_reader):
        assert not sse.done
        assert sse.last_error is not None
        assert sse.last_error["code"] == "stream_cancelled"
    (record,) = record_for(backend, marker)
    assert await wait_for(lambda: record.closed_at is not None, CANCEL_BOUND)
    assert record.closed_at is not None
    print(f"explicit cancel (resumable, from the other edge): backend closed "
          f"{(record.closed_at - cancelled_at) * 1000:.1f} ms after the POST was sent")
    assert record.closed_at - cancelled_at < CANCEL_BOUND
    assert not record.completed


async def test_cancel_of_a_plain_stream_from_another_edge(
        pipelines: Any, backend: FakeBackend) -> None:
    pipeline = pipelines()
    a, b = pipeline.edge_urls
    marker = f"plaincancel-{uuid.uuid4().hex}"
    async with aiohttp.ClientSession() as session:
        resp = await session.post(f"{a}/v1/chat/completions",
                                  json=body(marker, max_tokens=5000), headers=AUTH)
        assert "x-tidegate-resumable" not in resp.headers
        request_id = resp.headers["x-request-id"]
        first = await Sse().read(resp, events=3)
        assert first.ids == []
        assert first.blocks[0].startswith(b"data: ")
        cancelled_at = time.monotonic()
        cancelled = await session.post(f"{b}/v1/streams/{request_id}/cancel", headers=AUTH)
        assert cancelled.status == 200, await cancelled.text()
        rest = await asyncio.wait_for(first.read(resp), 10)
        # A plain stream has no log: nothing to resume.
        gone = await session.get(f"{b}/v1/streams/{request_id}", headers=AUTH)
        assert gone.status == 404
    assert rest.last_error is not None
    assert rest.last_error["code"] == "stream_cancelled"
    (record,) = record_for(backend, marker)
    assert await wait_for(lambda: record.closed_at is not None, CANCEL_BOUND)
    assert record.closed_at is not None
    assert record.closed_at - cancelled_at < CANCEL_BOUND
    assert not record.completed


async def test_grace_cancels_after_it_and_not_before(
        pipelines: Any, backend: FakeBackend) -> None:
    grace = 2.0
    pipeline = pipelines()
    a, b = pipeline.edge_urls
    gone, back = f"gone-{uuid.uuid4().hex}", f"back-{uuid.uuid4().hex}"
    headers = {**RESUMABLE, "X-Tidegate-Resume-Grace": str(grace)}
    async with aiohttp.ClientSession() as session:
        resp = await session.post(f"{a}/v1/chat/completions",
                                  json=body(gone, max_tokens=100_000, fake_itl=0.005),
                                  headers=headers)
        await Sse().read(resp, events=3)
        abort(resp)
        left = time.monotonic()

        resp = await session.post(f"{a}/v1/chat/completions",
                                  json=body(back, max_tokens=400), headers=headers)
        request_id = resp.headers["x-request-id"]
        first = await Sse().read(resp, events=5)
        abort(resp)
        await asyncio.sleep(grace / 4)
        rest = await replay(session, b, request_id, after=first.ids[-1])
        full = await replay(session, a, request_id)

    (record,) = record_for(backend, gone)
    assert await wait_for(lambda: record.closed_at is not None, grace + 6.0), \
        "the abandoned stream was never cancelled"
    assert record.closed_at is not None
    assert record.closed_at - left >= grace  # not before the grace
    assert record.closed_at - left < grace + 3.0
    assert rest.done
    assert first.events + rest.events == full.events
    assert record_for(backend, back)[0].completed


async def test_opt_in_by_tenant_setting_live_by_model_and_by_header(
        pipelines: Any, backend: FakeBackend) -> None:
    pipeline = pipelines(edges=1, models=[
        {"name": "fake", "backend": "openai", "base_url": backend.base_url},
        {"name": "fake-resumable", "backend": "openai", "base_url": backend.base_url,
         "upstream_model": "fake", "resumable": True}])
    url = pipeline.url
    key = await tenant_key(pipeline, "acme")

    async def resumable(model: str, headers: dict[str, str]) -> bool:
        async with aiohttp.ClientSession() as session:
            resp = await session.post(f"{url}/v1/chat/completions",
                                      json={**body(uuid.uuid4().hex, max_tokens=3),
                                            "model": model}, headers=headers)
            sse = await Sse().read(resp)
            assert sse.done
            flagged = resp.headers.get("x-tidegate-resumable") == "true"
            assert flagged == (sse.ids == list(range(1, len(sse.events) + 1)))
            return flagged

    acme = {"Authorization": f"Bearer {key}"}
    assert not await resumable("fake", acme)
    assert await resumable("fake-resumable", acme)
    assert not await resumable("fake-resumable", {**acme, "X-Tidegate-Resumable": "false"})
    assert await resumable("fake", {**acme, "X-Tidegate-Resumable": "true"})

    async def cli(*args: str) -> None:
        await asyncio.to_thread(subprocess.run, [
            sys.executable, "-m", "fleet", "tenant", *args, "--config",
            str(pipeline.config_path)], check=True, capture_output=True)

    await cli("set", "acme", "--resumable", "on")
    deadline = time.monotonic() + 5
    while not await resumable("fake", acme):  # applied live, no restart
        assert time.monotonic() < deadline, "the tenant setting never reached the edge"
        await asyncio.sleep(0.05)
    assert not await resumable("fake", AUTH)  # another tenant: unchanged
    await cli("set", "acme", "--resumable", "off")
    deadline = time.monotonic() + 5
    while await resumable("fake", acme):
        assert time.monotonic() < deadline, "turning the setting off never applied"
        await asyncio.sleep(0.05)


def reconnect_of(sse: Sse) -> dict[str, Any] | None:
    """The reconnect event's data, if the stream ended with it."""
    if sse.blocks and sse.blocks[-1].startswith(b"event: reconnect\n"):
        return dict(json.loads(sse.blocks[-1].split(b"data: ", 1)[1]))
    return None


async def test_edge_drain_tells_resumable_clients_to_reconnect(
        pipelines: Any, backend: FakeBackend) -> None:
    pipeline = pipelines(edge={"shutdown_timeout": 20.0})
    a, b = pipeline.edge_urls
    markers = [f"drain-{uuid.uuid4().hex}" for _ in range(2)]
    async with aiohttp.ClientSession() as session:
        live = await session.post(f"{a}/v1/chat/completions",
                                  json=body(markers[0], max_tokens=600), headers=RESUMABLE)
        other = await session.post(f"{b}/v1/chat/completions",
                                   json=body(markers[1], max_tokens=600), headers=RESUMABLE)
        rids = [live.headers["x-request-id"], other.headers["x-request-id"]]
        # A resumed reader on A of a stream that started on B.
        resumed = await session.get(f"{a}/v1/streams/{rids[1]}", headers=AUTH)
        firsts = [await Sse().read(live, events=5), await Sse().read(resumed, events=5)]
        await Sse().read(other, events=1)
        abort(other)
        stopping = asyncio.get_running_loop().run_in_executor(None, pipeline.edge.stop)
        started = time.monotonic()
        for first, resp in zip(firsts, (live, resumed), strict=True):
            await asyncio.wait_for(first.read(resp), 10)
        told = time.monotonic() - started
        await stopping
        fulls = []
        for rid, first in zip(rids, firsts, strict=True):
            event = reconnect_of(first)
            assert event is not None, first.blocks[-3:]
            assert event["last_event_id"] == first.ids[-1]
            assert event["resume_url"] == f"/v1/streams/{rid}"
            assert not first.done
            rest = await replay(session, b, rid, after=event["last_event_id"])
            full = await replay(session, b, rid)
            assert rest.done
            assert first.events + rest.events == full.events
            fulls.append(full)
    # At once, not at the end of the drain's 20 s grace (which would end the
    # streams with an error, not a reconnect): the grace is the bound.
    assert told < 20.0
    for marker, full in zip(markers, fulls, strict=True):
        assert payloads(full) == backend_events(backend, marker)


async def follow(session: aiohttp.ClientSession, urls: list[str], first: aiohttp.ClientResponse,
                 request_id: str) -> Sse:
    """A client that follows reconnect events (and a dropped connection) to
    whichever edge answers, until the stream's end. Returns every event once."""
    got = await Sse().read(first)
    events = list(got.events)
    last = got.ids[-1] if got.ids else 0
    done = got.done
    reconnects = int(reconnect_of(got) is not None)
    turn = 0
    deadline = time.monotonic() + 60
    while not done:
        assert time.monotonic() < deadline, "the stream never completed"
        turn += 1
        url = urls[turn % len(urls)]
        try:
            resp = await session.get(f"{url}/v1/streams/{request_id}",
                                     headers={**AUTH, "Last-Event-ID": str(last)})
            if resp.status != 200:
                await asyncio.sleep(0.1)
                continue
            part = await Sse().read(resp)
        except aiohttp.ClientError:
            await asyncio.sleep(0.1)  # that edge is down: the other one
            continue
        events.extend(part.events)
        if part.ids:
            last = part.ids[-1]
        done = part.done
        if reconnect_of(part) is not None:
            reconnects += 1
        else:
            assert done or part.last_error is None, part.last_error
    out = Sse()
    out.blocks = [*events, b"data: [DONE]"]
    out.reconnects = reconnects
    return out


@pytest.mark.slow
async def test_rolling_restart_of_both_edges_loses_no_resumable_stream(
        pipelines: Any, backend: FakeBackend) -> None:
    pipeline = pipelines(edge={"shutdown_timeout": 20.0})
    urls = pipeline.edge_urls
    n = 8
    markers = [f"rolling-{uuid.uuid4().hex}" for _ in range(n)]
    async with aiohttp.ClientSession() as session:

        async def one(i: int) -> tuple[str, Sse]:
            await asyncio.sleep(i * 0.2)  # spread over the restarts
            for attempt in range(20):  # a new request goes to an edge that is up
                try:
                    resp = await session.post(
                        f"{urls[(i + attempt) % 2]}/v1/chat/completions",
                        json=body(markers[i], max_tokens=800, fake_itl=0.005),
                        headers=RESUMABLE)
                except aiohttp.ClientError:
                    await asyncio.sleep(0.1)
                    continue
                if resp.status == 200:
                    break
                await asyncio.sleep(0.1)  # 503 edge_draining: the other one
            assert resp.status == 200
            rid = resp.headers["x-request-id"]
            return rid, await follow(session, urls, resp, rid)

        clients = asyncio.gather(*(one(i) for i in range(n)))
        loop = asyncio.get_running_loop()
        for edge in pipeline.edges:  # one at a time, as a rollout does
            await asyncio.sleep(0.7)
            await loop.run_in_executor(None, edge.restart)
        results = await asyncio.wait_for(clients, 90)
        for (rid, got), marker in zip(results, markers, strict=True):
            full = await replay(session, urls[0], rid)
            assert got.ids == list(range(1, len(got.events) + 1)), marker
            assert got.events == full.events
            assert payloads(full) == backend_events(backend, marker)
    assert sum(got.reconnects for _, got in results) >= 1  # the restarts did hit streams


async def test_worker_killed_mid_stream_ends_with_retryable_error_and_log_keeps_output(
        pipelines: Any, backend: FakeBackend) -> None:
    pipeline = pipelines()
    a, b = pipeline.edge_urls
    marker = f"workerdeath-{uuid.uuid4().hex}"
    async with aiohttp.ClientSession() as session:
        resp = await session.post(f"{a}/v1/chat/completions",
                                  json=body(marker, max_tokens=100_000, fake_itl=0.005),
                                  headers=RESUMABLE)
        request_id = resp.headers["x-request-id"]
        live = await Sse().read(resp, events=10)
        pipeline.workers[0].kill()
        await asyncio.wait_for(live.read(resp), 30)
        replayed = await asyncio.wait_for(replay(session, b, request_id), 30)
    # A generation cannot be spliced: a clean, retryable end, never a hang.
    for sse in (live, replayed):
        assert not sse.done
        assert sse.last_error is not None
        assert sse.last_error["code"] == "worker_lost"
        assert sse.last_error["retryable"] is True
    # The log kept every event the worker sent before it died.
    got = [e for e in live.events if e.startswith(b"id: ")]
    kept = [e for e in replayed.events if e.startswith(b"id: ")]
    assert len(got) >= 10
    assert kept[:len(got)] == got
    assert replayed.ids == list(range(1, len(kept) + 1))
