"""The relay's direct write path (edge.relay.Relay._direct), in process: a real
aiohttp server whose handler runs a Relay over a Session, a real aiohttp client
reading the response, the test playing the worker by feeding the session, and a
recording Publisher in place of NATS for the acks and cancels."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import socket
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from edge.relay import Relay, RelayContext
from edge.session import Session
from edge.sse_writer import SseWriter
from edge.stream import Phase
from tidegate.broker.link import Link
from tidegate.config import Config, SessionConfig
from tidegate.errors import ApiError
from tidegate.wire.flow import SendWindow
from tidegate.wire.protocol import (
    Ack,
    Admission,
    Api,
    Cancel,
    Chunk,
    ControlMessage,
    Detach,
    Done,
    Error,
    ErrorInfo,
    Head,
    Heartbeat,
    Request,
    Retransmit,
    Status,
    decode_control,
)

CONTROL = "tg.ctl.worker-test"
DONE = b"data: [DONE]\n\n"


class RecordingPublisher:
    """The relay's Publisher seam: records what would go to NATS. ``on_ack``
    lets a test play the worker's send window."""

    def __init__(self) -> None:
        self.published: list[tuple[str, bytes]] = []
        self.tombstones: list[tuple[str, str]] = []
        self.on_ack: Callable[[Ack], None] | None = None

    async def publish(self, subject: str, payload: bytes) -> None:
        self.published.append((subject, payload))
        message = decode_control(payload)
        if self.on_ack is not None and isinstance(message, Ack):
            self.on_ack(message)

    async def tombstone(self, request_id: str, reason: str) -> None:
        self.tombstones.append((request_id, reason))

    def control(self) -> list[ControlMessage]:
        assert all(subject == CONTROL for subject, _ in self.published)
        return [decode_control(payload) for _, payload in self.published]

    def acks(self) -> list[int]:
        return [m.seq for m in self.control() if isinstance(m, Ack)]


def make_request(rid: str, *, window_bytes: int = 64 << 10, window_msgs: int = 128,
                 stream: bool = True) -> Request:
    return Request(id=rid, reply=f"tg.out.edge-test.{rid}", model="fake", api=Api.CHAT,
                   stream=stream, body={"model": "fake", "messages": []}, created_ms=0,
                   deadline_ms=0, window_bytes=window_bytes, window_msgs=window_msgs, mux="")


@dataclass
class Opened:
    session: Session
    relay: Relay
    transport: asyncio.Transport


@dataclass
class Harness:
    client: TestClient[web.Request, web.Application]
    publisher: RecordingPublisher
    config: Config
    request: Request = field(default_factory=lambda: make_request("r-direct"))
    sndbuf: int = 0  # >0: shrink the server socket's send buffer
    link: Link = field(default_factory=lambda: Link(None, 0.0))
    opened: asyncio.Queue[Opened] = field(default_factory=asyncio.Queue)
    # (seq, written, socket buffer before, whether an ack was due after it)
    direct_calls: list[tuple[int, bool, int, bool]] = field(default_factory=list)

    async def start(self, path: str = "/stream") -> tuple[asyncio.Task[Any], Opened]:
        """Send the HTTP request; returns (response task, the handler's session)."""
        task = asyncio.create_task(self.client.get(path))
        async with asyncio.timeout(5):
            opened = await self.opened.get()
        return task, opened


HARNESS: web.AppKey[Harness] = web.AppKey("harness", Harness)


async def handler(http: web.Request) -> web.StreamResponse:
    h = http.app[HARNESS]
    config = h.config
    # As edge.app: a third of a heartbeat, within [0.05, 5] seconds.
    tick = min(max(config.session.heartbeat_interval / 3, 0.05), 5.0)
    session = Session(h.request.id, tick)
    headers = {"x-request-id": h.request.id}
    relay = Relay(SseWriter(http, h.request, headers, config), session, h.request,
                  RelayContext(config, h.publisher, h.link), headers)
    transport = http.transport
    assert isinstance(transport, asyncio.Transport)
    if h.sndbuf:
        sock = transport.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, h.sndbuf)
    h.opened.put_nowait(Opened(session, relay, transport))
    try:
        return await relay.run()
    finally:
        session.close()


@pytest.fixture
async def harness(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Harness]:
    calls: list[tuple[int, bool, int, bool]] = []
    original = Relay._direct

    def spy(self: Relay, chunk: Chunk) -> bool:
        assert isinstance(self.out, SseWriter)
        transport = self.out.http.transport
        buffered = transport.get_write_buffer_size() if transport is not None else -1
        quiet = self.acks.quiet_after(len(chunk.data))
        written = original(self, chunk)
        calls.append((chunk.seq, written, buffered, quiet))
        return written

    monkeypatch.setattr(Relay, "_direct", spy)
    app = web.Application()
    app.router.add_get("/stream", handler)
    client: TestClient[web.Request, web.Application] = TestClient(TestServer(app))
    h = Harness(client=client, publisher=RecordingPublisher(), config=Config(),
                direct_calls=calls)
    app[HARNESS] = h
    await client.start_server()
    try:
        yield h
    finally:
        await client.close()


async def wait_for(predicate: Callable[[], bool], within: float = 5.0) -> None:
    """Poll ``predicate`` each loop iteration (then every ms) until true."""
    deadline = time.monotonic() + within
    spins = 0
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        spins += 1
        await asyncio.sleep(0 if spins < 100 else 0.001)


def relay_idle(opened: Opened) -> Callable[[], bool]:
    """The relay has handled everything and re-installed its direct writer."""
    return lambda: opened.session.direct is not None and not opened.session._pending


def event(i: int, size: int = 0) -> bytes:
    """One SSE event that names its index; ``size`` pads it to that length."""
    head = b'data: {"i": %d, "pad": "' % i
    tail = b'"}\n\n'
    return head + b"x" * max(0, size - len(head) - len(tail)) + tail


def event_indexes(body: bytes) -> list[int | str]:
    """The indexes of the body's events, and "[DONE]" for the end marker."""
    out: list[int | str] = []
    for block in body.split(b"\n\n"):
        if not block:
            continue
        assert block.startswith(b"data: "), block[:80]
        payload = block[6:]
        out.append("[DONE]" if payload == b"[DONE]" else json.loads(payload)["i"])
    return out


async def start_streaming(h: Harness) -> tuple[aiohttp.ClientResponse, Opened, list[bytes]]:
    """Head, then the first chunk: headers go out and the direct writer is
    installed. Returns (response, opened, the chunk data sent so far)."""
    task, opened = await h.start()
    session = opened.session
    assert session.direct is None
    session.feed(Head(1, CONTROL, 7, 1))
    await wait_for(lambda: opened.relay.phase is Phase.STREAMING)
    assert session.direct is None, "direct writer before any chunk was written"
    first = event(0)
    session.feed(Chunk(2, first))
    async with asyncio.timeout(5):
        resp: aiohttp.ClientResponse = await task
    assert resp.status == 200
    assert resp.headers["Transfer-Encoding"] == "chunked"
    assert resp.headers["x-tidegate-job-seq"] == "7"
    await wait_for(relay_idle(opened))
    return resp, opened, [first]


async def paced_stream(h: Harness, n: int) -> tuple[bytes, Opened, list[bytes], list[int]]:
    """``n`` chunks after the first, each fed once the relay is idle, then Done.
    Returns (body, opened, chunk data, seqs that stayed queued after feed)."""
    resp, opened, sent = await start_streaming(h)
    session = opened.session
    queued: list[int] = []
    for i in range(1, n + 1):
        await wait_for(relay_idle(opened))
        data = event(i)
        sent.append(data)
        session.feed(Chunk(i + 2, data))
        if session._pending:
            queued.append(i + 2)
    session.feed(Done(n + 3, 5, n + 1, "stop"))
    async with asyncio.timeout(5):
        body = await resp.read()
    return body, opened, sent, queued


# --------------------------------------------------------------------------


async def test_direct_writer_takes_in_order_chunks(harness: Harness) -> None:
    n = 100
    body, opened, sent, queued = await paced_stream(harness, n)
    # The aiohttp client parsed the chunked body: every chunk, in order, then [DONE].
    assert body == b"".join(sent) + DONE
    assert event_indexes(body) == [*range(n + 1), "[DONE]"]
    # Every chunk after the first was offered to the direct writer, and only
    # those after which an ack was due (half of window_msgs) went to the
    # relay; the rest never woke it.
    calls = harness.direct_calls
    assert [seq for seq, *_ in calls] == list(range(3, n + 3))
    declined = [seq for seq, written, *_ in calls if not written]
    assert declined == queued
    half = harness.request.window_msgs // 2
    assert declined == list(range(2 + half - 1, n + 3, half))
    assert len(calls) - len(declined) == n - len(declined) > 0.9 * n
    assert opened.session.direct is None  # removed for the end of the stream
    assert harness.publisher.tombstones == []


async def test_acks_are_cumulative_and_published_to_the_control_subject(
        harness: Harness) -> None:
    n = 100
    _, _, _, queued = await paced_stream(harness, n)
    messages = harness.publisher.control()
    assert messages, "no ack published"
    assert all(isinstance(m, Ack) and m.request_id == "r-direct" for m in messages)
    acks = harness.publisher.acks()
    half = harness.request.window_msgs // 2
    assert n > half
    # Acks cover everything the direct path wrote before them, exactly as the
    # relay alone would have acked: once half a window has been written.
    assert acks == list(range(2 + half - 1, n + 3, half))
    assert acks == queued
    assert acks == sorted(set(acks))


async def test_burst_is_queued_behind_the_first_declined_chunk(harness: Harness) -> None:
    """Chunks fed faster than the relay runs: once one is queued, every later
    one queues behind it (never overtakes it to the socket), and one
    cumulative ack covers the batch."""
    n = 100
    resp, opened, sent = await start_streaming(harness)
    session = opened.session
    for i in range(1, n + 1):  # all in one go: the relay task cannot run in between
        data = event(i)
        sent.append(data)
        session.feed(Chunk(i + 2, data))
    half = harness.request.window_msgs // 2
    first_declined = 2 + half - 1
    assert [seq for seq, *_ in harness.direct_calls] == list(range(3, first_declined + 1))
    assert [m.seq for m in session._pending] == list(range(first_declined, n + 3))
    session.feed(Done(n + 3, 1, n + 1, "stop"))
    async with asyncio.timeout(5):
        body = await resp.read()
    assert body == b"".join(sent) + DONE
    assert harness.publisher.acks() == [n + 2]


async def test_a_gap_is_asked_again_and_the_stream_goes_on_byte_exact(
        harness: Harness) -> None:
    resp, opened, sent = await start_streaming(harness)
    session = opened.session
    session.feed(Chunk(3, event(1)))
    assert not session._pending  # written directly
    sent.append(event(1))
    session.feed(Chunk(5, event(3)))  # seq 4 lost in transit
    assert [m.seq for m in session._pending] == [5]  # not written directly
    await wait_for(lambda: Retransmit("r-direct", 4) in harness.publisher.control())
    session.feed(Chunk(6, event(4)))  # still in flight behind the gap: dropped too
    # The worker sends everything from 4 again; the edge drops what it has.
    for seq, i in ((4, 2), (5, 3), (6, 4), (5, 3)):
        session.feed(Chunk(seq, event(i)))
    sent.extend(event(i) for i in (2, 3, 4))
    session.feed(Done(7, 1, 5, "stop"))
    async with asyncio.timeout(5):
        body = await resp.read()
    assert body == b"".join(sent) + DONE
    control = harness.publisher.control()
    assert not [m for m in control if isinstance(m, Cancel)]
    assert harness.publisher.tombstones == []
    # One ask for the burst behind one gap (rate-limited), not one per message.
    assert [m for m in control if isinstance(m, Retransmit)] == [Retransmit("r-direct", 4)]


async def test_a_gap_never_filled_ends_with_stream_gap(harness: Harness) -> None:
    harness.config = Config(session=SessionConfig(heartbeat_interval=0.2, worker_lost_after=3))
    resp, opened, sent = await start_streaming(harness)
    session = opened.session
    session.feed(Chunk(4, event(2)))  # seq 3 lost, and the worker never resends it
    started = time.monotonic()
    while time.monotonic() - started < 0.5:  # the worker is alive: heartbeats past the gap
        session.feed(Heartbeat(5))
        await asyncio.sleep(0.05)
    async with asyncio.timeout(5):
        body = await resp.read()
    blocks = [b for b in body.split(b"\n\n") if b]
    assert blocks[0] + b"\n\n" == sent[0]
    error = json.loads(blocks[-1][6:])["error"]
    assert error["code"] == "stream_gap"
    assert event(2) not in body
    asks = [m for m in harness.publisher.control() if isinstance(m, Retransmit)]
    assert len(asks) >= 2  # asked again while the gap stayed open
    assert {m.seq for m in asks} == {3}
    assert harness.publisher.tombstones == [("r-direct", "edge:stream_gap")]


async def test_chunks_batched_with_an_error_reach_the_client_before_it(
        harness: Harness) -> None:
    """Issue 26: a loaded edge takes the first chunks and the worker's Error in
    one batch. The chunks came first, so they go out (200, headers sent) and
    the error is the stream's final event, never a 502 that drops them."""
    task, opened = await harness.start()
    session = opened.session
    info = ErrorInfo(502, "server_error", "backend_error", "The backend broke the stream.")
    # All before the relay task runs: it takes them as one batch.
    for message in (Head(1, CONTROL, 7, 1), Chunk(2, event(0)), Chunk(3, event(1)),
                    Error(4, info)):
        session.feed(message)
    async with asyncio.timeout(5):
        resp = await task
        body = await resp.read()
    assert resp.status == 200, body
    blocks = [b for b in body.split(b"\n\n") if b]
    assert blocks[:2] == [event(0)[:-2], event(1)[:-2]]
    assert json.loads(blocks[-1][6:])["error"]["code"] == "backend_error"
    assert len(blocks) == 3
    assert DONE not in body


async def test_no_direct_writer_for_a_non_streaming_response(harness: Harness) -> None:
    harness.request = make_request("r-plain", stream=False)
    task, opened = await harness.start()
    session = opened.session
    session.feed(Head(1, CONTROL))
    parts = [b'{"choices": [', b'{"index": 0}', b"]}"]
    for seq, part in enumerate(parts, start=2):
        session.feed(Chunk(seq, part))
        await wait_for(lambda: not session._pending)
        assert session.direct is None
    session.feed(Done(5, 1, 1, "stop"))
    async with asyncio.timeout(5):
        resp = await task
        assert await resp.read() == b"".join(parts)
    assert harness.direct_calls == []


@pytest.mark.parametrize(("n", "size"), [(1500, 3000), (3000, 1000)])
async def test_order_holds_when_a_slow_client_forces_the_fallback(
        harness: Harness, n: int, size: int) -> None:
    """Small high-water mark (4096), KiB-sized chunks, a client that starts
    reading late and then reads slowly, and a worker that respects its window:
    every chunk arrives exactly once, in order, some written directly and the
    rest by the relay (ack due, or, with 1 KiB chunks, the socket buffer full;
    3 KiB chunks mostly queue behind the relay's drain and are seldom offered)."""
    harness.request = make_request("r-slow", window_bytes=16 << 10, window_msgs=128)
    harness.sndbuf = 4096
    resp, opened, sent = await start_streaming(harness)
    relay, session = opened.relay, opened.session
    assert relay.out.high_water == 4096
    # The worker's side of the flow control, fed by the edge's acks.
    window = SendWindow(harness.request.window_bytes, harness.request.window_msgs)
    window.on_send(2, len(sent[0]))  # the first chunk (the Head is not windowed)
    window_open = asyncio.Event()
    window_open.set()

    def on_ack(ack: Ack) -> None:
        if window.on_ack(ack.seq) and window.open:
            window_open.set()

    harness.publisher.on_ack = on_ack

    async def worker() -> None:
        for i in range(1, n + 1):
            if not window.open:
                window_open.clear()
                await window_open.wait()
            data = event(i, size)
            sent.append(data)
            window.on_send(i + 2, len(data))
            session.feed(Chunk(i + 2, data))
            if i % 3 == 0:
                await asyncio.sleep(0)
        session.feed(Done(n + 3, 1, n + 1, "stop"))

    async def slow_reader() -> bytes:
        await asyncio.sleep(0.5)  # reads nothing at first
        parts = []
        while chunk := await resp.content.read(8192):
            parts.append(chunk)
            if len(parts) % 8 == 0:
                await asyncio.sleep(0.002)
        return b"".join(parts)

    async with asyncio.timeout(20):
        body, _ = await asyncio.gather(slow_reader(), worker())
    assert event_indexes(body) == [*range(n + 1), "[DONE]"]
    assert body == b"".join(sent) + DONE
    calls = harness.direct_calls
    assert [seq for seq, *_ in calls] == sorted({seq for seq, *_ in calls})
    written = [seq for seq, ok, *_ in calls if ok]
    # Declined only because the socket buffer was full (in order, no ack due).
    buffer_full = [seq for seq, ok, buffered, quiet in calls
                   if not ok and quiet and buffered + size > relay.out.high_water]
    # Never written past the high-water mark: a direct write counts as drained.
    assert all(buffered + size <= relay.out.high_water for _, ok, buffered, _ in calls if ok)
    print(f"{len(written)} of {n} chunks written directly; {len(buffer_full)} declined "
          f"for a full socket buffer; {len(harness.publisher.acks())} acks")
    assert written, "the direct path never wrote"
    assert len(written) < len(calls), "the direct path never declined"
    if 3 * size < relay.out.high_water:
        assert buffer_full, "the socket buffer never filled: the fallback was not exercised"
    assert harness.publisher.acks() == sorted(set(harness.publisher.acks()))
    assert harness.publisher.tombstones == []


async def test_an_ended_relay_writes_nothing_directly(harness: Harness) -> None:
    """Regression: the direct writer outlived an abort, so a chunk from a
    worker not yet cancelled could follow the error event and the chunked
    terminator onto a keep-alive connection."""
    resp, opened, _ = await start_streaming(harness)
    session = opened.session
    assert session.direct is not None
    session.abort(ApiError(503, "This edge is shutting down.", type="service_unavailable",
                           code="edge_shutting_down", retryable=True))
    # The cancel is published after the writer is gone and before the error
    # event is written, so a chunk offered now must not reach the socket.
    await wait_for(lambda: bool(harness.publisher.tombstones))
    assert session.direct is None
    session.feed(Chunk(3, b"data: LATE\n\n"))
    assert not [call for call in harness.direct_calls if call[0] == 3]
    async with asyncio.timeout(5):
        body = await resp.read()
    assert b"edge_shutting_down" in body
    assert b"LATE" not in body


async def test_an_empty_chunk_does_not_end_the_body(harness: Harness) -> None:
    """An empty chunk frame is the chunked terminator: the direct writer must
    leave it to the relay, which writes nothing for it."""
    resp, opened, sent = await start_streaming(harness)
    session = opened.session
    session.feed(Chunk(3, b""))
    await wait_for(relay_idle(opened))
    session.feed(Chunk(4, event(1)))
    session.feed(Done(5, 1, 2, "stop"))
    async with asyncio.timeout(5):
        body = await resp.read()
    assert body == sent[0] + event(1) + DONE


async def test_a_resumable_stream_with_a_gap_not_filled_is_sent_to_resume(
        harness: Harness) -> None:
    harness.config = Config(session=SessionConfig(heartbeat_interval=0.2, worker_lost_after=50))
    harness.request = dataclasses.replace(make_request("r-resumable"), resumable=True,
                                          grace=5.0)
    task, opened = await harness.start()
    session = opened.session
    session.feed(Head(1, CONTROL, 7, 1))
    session.feed(Chunk(2, event(0) + event(1)))
    async with asyncio.timeout(5):
        resp = await task
    session.feed(Chunk(4, event(3)))  # seq 3 lost, never resent
    async with asyncio.timeout(5):
        body = await resp.read()
    blocks = [b for b in body.split(b"\n\n") if b]
    # The retry field rides in the first event's block (the openai SDK reads a
    # block of its own as an event with empty data).
    assert blocks[:2] == [b"retry: 1000\nid: 1\n" + event(0)[:-2], b"id: 2\n" + event(1)[:-2]]
    assert blocks[-1].startswith(b"event: reconnect\ndata: ")
    reconnect = json.loads(blocks[-1].split(b"data: ", 1)[1])
    assert reconnect == {"resume_url": "/v1/streams/r-resumable", "last_event_id": 2,
                         "retry_ms": 1000}
    control = harness.publisher.control()
    assert Detach("r-resumable", "") in control  # detached, not cancelled
    assert not [m for m in control if isinstance(m, Cancel)]
    assert harness.publisher.tombstones == []


class CutClient:
    """A NATS client as nats-py shows one cut from every node: reconnecting."""
    is_connected = False
    is_closed = False
    stats = {"reconnects": 0}


@pytest.mark.parametrize("resumable", [True, False])
async def test_a_queued_stream_on_an_edge_cut_from_nats_is_released(
        harness: Harness, resumable: bool) -> None:
    """A stream the client already has a 200 for (its queue note went out)
    but whose worker has not started is released when the edge loses NATS,
    as a streaming one is: a resumable one with the reconnect event from
    event 0 (its log and request were stored before the relay began, so
    another edge's resume reads it whole), any other with a retryable
    broker_unavailable. Before, a resumable one got the error too: a begun
    stream that never completed (seen in test_partitions under load)."""
    harness.config = Config(session=SessionConfig(heartbeat_interval=0.15))
    harness.request = dataclasses.replace(make_request("r-queued"), resumable=resumable,
                                          grace=5.0 if resumable else 0.0)
    harness.link = Link(CutClient(), 0.1)  # type: ignore[arg-type]
    task, opened = await harness.start()
    opened.session.feed(Status(Admission.QUEUED, position=3))
    async with asyncio.timeout(5):
        resp = await task
        assert resp.status == 200
        body = await resp.read()
    blocks = [b for b in body.split(b"\n\n") if b]
    assert blocks[0].startswith(b":"), blocks  # the queue note: the client had its 200
    if resumable:
        assert blocks[-1].startswith(b"event: reconnect\ndata: "), blocks
        reconnect = json.loads(blocks[-1].split(b"data: ", 1)[1])
        assert reconnect["resume_url"] == "/v1/streams/r-queued"
        assert reconnect["last_event_id"] == 0
        assert harness.publisher.tombstones == []  # detached: the job runs on, into the log
    else:
        error = json.loads(blocks[-1].split(b"data: ", 1)[1])["error"]
        assert error["code"] == "broker_unavailable", error
