"""What docs/resume.md promises and no other test proved, against real servers
(issue 26): several readers of one stream each get every event once; a
stream past ``resume.max_stream_bytes`` ends its log with ``resume_log_full``;
a stream nobody reads ends its log with ``stream_abandoned`` after the grace;
a ``Last-Event-ID`` that is not a non-negative integer is a 400
``invalid_value``. Each was seen failing with the promise broken.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import aiohttp
import pytest

from bench.fake_backend import FakeBackend
from tests import test_resume
from tests.pipeline import record_for
from tests.poll import eventually
from tests.test_resume import AUTH, RESUMABLE, Sse, abort, body, replay

pytestmark = pytest.mark.pipeline

# test_resume's fixtures, the same here: its fake backend, and pipelines of
# two edges with short heartbeats.
backend = test_resume.backend
pipelines = test_resume.pipelines

def numbered(sse: Sse) -> list[bytes]:
    """The stream's events, without a final error event (which has no id)."""
    return [e for e in sse.events if e.startswith(b"id: ")]


def final_error(sse: Sse) -> str | None:
    """The code of the stream's final error event, if it ended with one."""
    error = sse.last_error
    return None if error is None else str(error["code"])


async def test_every_reader_of_one_stream_gets_every_event_once(
        pipelines: Any, backend: FakeBackend) -> None:
    """The original connection and two resumed readers on two edges, all
    reading while the stream generates: each gets ids 1..N, each event once,
    byte for byte what a replay of the finished stream holds."""
    pipeline = pipelines()
    a, b = pipeline.edge_urls
    marker = f"readers-{uuid.uuid4().hex}"
    async with aiohttp.ClientSession() as session:
        resp = await session.post(f"{a}/v1/chat/completions",
                                  json=body(marker, max_tokens=400), headers=RESUMABLE)
        assert resp.status == 200
        request_id = resp.headers["x-request-id"]
        original = Sse()
        await original.read(resp, events=3)  # generating: the readers join a live stream
        readers = await asyncio.gather(
            original.read(resp),
            replay(session, a, request_id, after=0),
            replay(session, b, request_id, after=0))
        full = await replay(session, b, request_id)
    assert full.done
    assert full.ids == list(range(1, len(full.events) + 1))
    # The readers really read live: the backend was still writing when they began.
    assert len(full.events) > 3 + 50
    for sse in readers:
        assert sse.done
        assert sse.ids == full.ids
        assert sse.events == full.events


async def test_a_stream_past_max_stream_bytes_ends_its_log_with_resume_log_full(
        pipelines: Any, backend: FakeBackend) -> None:
    """The live connection gets the whole stream; the log, and so every
    resume, ends with ``resume_log_full`` after a prefix of it."""
    limit = 8192
    pipeline = pipelines(resume={"attach_interval": 0.5, "max_stream_bytes": limit})
    a, b = pipeline.edge_urls
    marker = f"full-{uuid.uuid4().hex}"
    async with aiohttp.ClientSession() as session:
        resp = await session.post(f"{a}/v1/chat/completions",
                                  json=body(marker, max_tokens=600, fake_itl=0.001),
                                  headers=RESUMABLE)
        assert resp.status == 200
        request_id = resp.headers["x-request-id"]
        live = await Sse().read(resp)
        resumed = await replay(session, b, request_id, after=0)
    assert live.done  # the live connection goes on past the bound
    assert sum(len(e) for e in live.events) > 2 * limit
    assert final_error(resumed) == "resume_log_full"
    assert not resumed.done
    kept = numbered(resumed)
    assert kept
    assert kept == live.events[:len(kept)]
    assert sum(len(e) for e in kept) <= limit


async def test_a_stream_nobody_reads_ends_with_stream_abandoned_after_its_grace(
        pipelines: Any, backend: FakeBackend) -> None:
    """Its client left, nobody resumed within the grace: the backend is
    closed and a reader who comes later reads ``stream_abandoned`` as the
    final event, after the events generated before."""
    pipeline = pipelines()
    a, b = pipeline.edge_urls
    marker = f"abandoned-{uuid.uuid4().hex}"
    headers = {**RESUMABLE, "X-Tidegate-Resume-Grace": "1"}
    async with aiohttp.ClientSession() as session:
        resp = await session.post(f"{a}/v1/chat/completions",
                                  json=body(marker, max_tokens=100_000, fake_itl=0.005),
                                  headers=headers)
        assert resp.status == 200
        request_id = resp.headers["x-request-id"]
        first = await Sse().read(resp, events=3)
        abort(resp)
        (record,) = await eventually(lambda: record_for(backend, marker), 30,
                                     "the backend saw the request")
        await eventually(lambda: record.closed_at is not None, 60,
                         "the abandoned stream's backend connection was closed")
        later = await replay(session, b, request_id, after=0)
    assert not record.completed
    assert final_error(later) == "stream_abandoned"
    assert not later.done
    assert numbered(later)[:3] == first.events
    assert later.ids == list(range(1, len(numbered(later)) + 1))


async def test_last_event_id_that_is_not_a_non_negative_integer_is_400(
        pipelines: Any, backend: FakeBackend) -> None:
    pipeline = pipelines()
    a, _ = pipeline.edge_urls
    marker = f"bad-id-{uuid.uuid4().hex}"
    async with aiohttp.ClientSession() as session:
        resp = await session.post(f"{a}/v1/chat/completions",
                                  json=body(marker, max_tokens=5), headers=RESUMABLE)
        request_id = resp.headers["x-request-id"]
        assert (await Sse().read(resp)).done
        ok = await replay(session, a, request_id, after=2)  # a valid one is served
        assert ok.done
        assert ok.ids[0] == 3
        for value in ("-1", "+5", "1_0", "\u0663", "1.0", "0x10", "abc", "1 2"):
            params = {"after": value}
            for headers, query in (({"Last-Event-ID": value}, {}), ({}, params)):
                if not value.isascii() and headers:
                    continue  # not a header value HTTP/1.1 carries; the query does
                got = await session.get(f"{a}/v1/streams/{request_id}", params=query,
                                        headers={**AUTH, **headers})
                assert got.status == 400, (value, await got.text())
                error = (await got.json())["error"]
                assert error["code"] == "invalid_value"
