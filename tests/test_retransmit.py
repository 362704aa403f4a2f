"""Lossless session recovery: the worker keeps what is not acked, the edge asks
for a lost message again (Retransmit), and the stream goes on byte-exact.

Unit tests of the sans-I/O parts, then the pipeline with a worker that drops
every Nth NATS message to its edge (``tests.faults.lossy_worker``), as a NATS
restart or a client reconnect would lose them."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from bench.fake_backend import FakeBackend
from tests.pipeline import DEV_KEY, Pipeline, record_for, threaded_fake_backend
from tidegate.wire.flow import SendWindow
from tidegate.wire.protocol import Chunk, Done, Error, ErrorInfo, Request
from workers.tails import Tails


def test_window_keeps_unacked_messages_in_seq_order() -> None:
    w = SendWindow(1 << 20, 100)
    w.hold(1, b"head")
    w.on_send(2, 1, 0.0, b"c2")
    w.hold(3, b"hb3")
    w.on_send(4, 1, 0.0, b"c4")
    w.hold(5, b"done")
    assert w.kept() == [(1, b"head"), (2, b"c2"), (3, b"hb3"), (4, b"c4"), (5, b"done")]
    assert [m for _, m in w.kept(3)] == [b"hb3", b"c4", b"done"]
    w.on_ack(2)
    assert [s for s, _ in w.kept()] == [3, 4, 5]
    w.on_ack(2)  # a duplicate ack changes nothing
    assert [s for s, _ in w.kept()] == [3, 4, 5]
    w.on_ack(5)
    assert w.kept() == []
    assert w.kept_bytes == 0


def request(rid: str) -> Request:
    return Request(id=rid, reply="r", model="m", api=0, stream=True, body={},  # type: ignore[arg-type]
                   created_ms=0, deadline_ms=0, window_bytes=1024, window_msgs=4)


def test_tails_expire_and_stay_under_their_byte_bound() -> None:
    tails = Tails(ttl=10.0, max_bytes=100)
    tails.keep(request("a"), [(4, b"x" * 40), (5, b"done")], now=0.0)
    got = tails.since("a", 5, now=1.0)
    assert got is not None
    assert got[1] == [b"done"]
    tails.keep(request("b"), [(2, b"y" * 70)], now=2.0)  # over 100 bytes: a goes
    assert tails.since("a", 0, now=2.0) is None
    assert tails.since("b", 0, now=2.0) is not None
    assert tails.since("b", 0, now=13.0) is None  # expired
    assert tails.bytes == 0
    tails.keep(request("c"), [(2, b"z" * 101)], now=14.0)  # larger than the bound
    assert len(tails) == 0


def test_a_tail_tells_a_job_that_ran_to_its_end_from_one_cut_off() -> None:
    """What a worker answers when another asks whether it ended a job
    (workers.service.Pool.on_presence): only a tail whose last message is
    the job's end (Done or Error) says so; a job fenced mid-stream keeps
    chunks only."""
    tails = Tails(ttl=10.0)
    tails.keep(request("done"), [(5, Chunk(5, b"data: x\n\n").encode()),
                                 (6, Done(6, 3, 5, "stop").encode())])
    tails.keep(request("failed"), [(2, Error(2, ErrorInfo(502, "server_error", "backend_error",
                                                           "boom", True, 1.0)).encode())])
    tails.keep(request("cut"), [(5, Chunk(5, b"data: x\n\n").encode())])
    assert tails.ended("done")
    assert tails.ended("failed")
    assert not tails.ended("cut")
    assert not tails.ended("unknown")


# ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def backend() -> Iterator[FakeBackend]:
    with threaded_fake_backend(models=["fake"], ttft=0.01, itl=0.002, tokens=10**9,
                               keep_output=True) as fake:
        yield fake


@pytest.mark.pipeline
async def test_lost_messages_are_sent_again_and_streams_stay_byte_exact(
        tmp_path: Path, module_nats_url: str, module_redis_url: str,
        backend: FakeBackend) -> None:
    overrides: dict[str, Any] = {
        "nats": {"subject_prefix": "x" + uuid.uuid4().hex[:8]},
        "session": {"heartbeat_interval": 1.0, "worker_lost_after": 5, "ack_timeout": 6.0},
        "models": [{"name": "fake", "backend": "openai", "base_url": backend.base_url}],
    }
    pipeline = Pipeline(tmp_path, module_nats_url, module_redis_url, overrides=overrides,
                        worker_launcher=("tests.faults.lossy_worker", "5"))
    pipeline.start()
    try:
        markers = [f"lossy-{uuid.uuid4().hex}" for _ in range(8)]
        async with aiohttp.ClientSession() as session:

            async def one(marker: str, resumable: bool) -> bytes:
                headers = {"Authorization": f"Bearer {DEV_KEY}"}
                if resumable:
                    headers["X-Tidegate-Resumable"] = "true"
                resp = await session.post(f"{pipeline.url}/v1/chat/completions", json={
                    "model": "fake", "stream": True, "max_tokens": 200,
                    "stream_options": {"include_usage": True},
                    "messages": [{"role": "user", "content": marker}]}, headers=headers)
                assert resp.status == 200
                body = await resp.read()
                # A resumable stream whose gap stays open past a heartbeat (a
                # loaded machine's slow resend) is sent to its log: the event
                # says where, and the client resumes there, as EventSource does.
                while resumable and b"event: reconnect\n" in body.rsplit(b"\n\n", 2)[-2]:
                    told = json.loads(body.rsplit(b"data: ", 1)[1])
                    async with session.get(f"{pipeline.url}{told['resume_url']}", headers={
                            **headers, "Last-Event-ID": str(told["last_event_id"])}) as again:
                        assert again.status == 200
                        body += await again.read()
                return body

            bodies = await asyncio.gather(*(one(m, i % 2 == 1) for i, m in enumerate(markers)))
        logs = (tmp_path / "logs" / "edge.log").read_text()
        assert "lost in transit" in logs  # the hook did drop messages
        for marker, body, i in zip(markers, bodies, range(len(markers)), strict=True):
            (record,) = record_for(backend, marker)
            assert record.completed
            assert body.endswith(b"data: [DONE]\n\n"), body[-300:]
            if i % 2:  # resumable: ids in front of each event, the events themselves intact
                # (The first event's block also carries the retry field.)
                blocks = (b.removeprefix(b"retry: 1000\n") for b in body.split(b"\n\n"))
                body = b"".join(b.split(b"\n", 1)[1] + b"\n\n" for b in blocks
                                if b.startswith(b"id: "))
                assert body == bytes(record.output).replace(b"data: [DONE]\n\n", b"")
            else:  # today's bytes, plus any ": ping" a stall waiting for a resend wrote
                assert body.replace(b": ping\n\n", b"") == bytes(record.output), json.dumps(i)
    finally:
        pipeline.stop()
