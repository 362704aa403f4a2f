"""workers/job.py's decision logic with fakes behind its seams: every way a
job ends, in seconds and without servers.

The seams: the JetStream message (``metadata``, ``headers``, ``ack``/``nak``/
``in_progress``), the NATS client (``publish``) and the backend
(``workers.backends.Backend`` / ``BackendStream``). What the job sent the edge
is decoded from the fake client's publishes, so each test asserts the wire
messages, the usage record and the message's fate (acked, handed back, or
left for redelivery), which are what the edge, the dispatcher and JetStream
see. The same ends run against real servers in test_lifecycle.py and
test_drain.py; these fail in seconds when a branch breaks.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import nats.errors
import pytest

from tests.poll import eventually
from tidegate import config as tgconfig
from tidegate.errors import BackendError
from tidegate.wire.mux import Outbox, decode_mux
from tidegate.wire.protocol import (
    DUPLICATE_DELIVERY,
    RESERVED_HEADER,
    Api,
    Chunk,
    Done,
    Error,
    Head,
    Heartbeat,
    Request,
    UsageRecord,
    decode_session,
)
from tidegate.wire.streamlog import LogCursor, LogOpen
from workers.backends import Usage
from workers.job import Job
from workers.job_context import JobContext
from workers.job_state import ACK_TIMEOUT, WORKER_SHUTDOWN
from workers.resumable import ResumableJob
from workers.tails import Tails

CONFIG = tgconfig.from_dict({
    "session": {"heartbeat_interval": 0.1, "ack_timeout": 0.6, "worker_lost_after": 6},
    "worker": {"ack_wait": 0.3, "resume_timeout": 0.3},
})
REPLY = "tg.out.edge1.r1"


class FakeMsg:
    """A JetStream message: what the job did with it."""

    def __init__(self, delivered: int = 1, reserved: bool = True) -> None:
        self.metadata = SimpleNamespace(num_delivered=delivered,
                                        sequence=SimpleNamespace(stream=42))
        self.headers = {RESERVED_HEADER: "1"} if reserved else {}
        # Named in the Head (tidegate.broker.liveness).
        self.reply = "$JS.ACK.TG_JOBS.workers.1.42.1.0.0"
        self.fate: list[str] = []

    async def ack(self) -> None:
        self.fate.append("ack")

    async def nak(self, delay: float | None = None) -> None:
        self.fate.append("nak")

    async def in_progress(self) -> None:
        self.fate.append("in_progress")

    async def term(self) -> None:
        self.fate.append("term")


class FakeNats:
    def __init__(self, refusals: int = 0) -> None:
        self.published: list[tuple[str, bytes]] = []
        # JetStream publishes (requests) stored, after ``refusals`` answered
        # "no responders" (a stream with no leader); and the order of events.
        self.stored: list[tuple[str, bytes, str]] = []
        self.refusals = refusals
        self.order: list[str] = []
        self.options: dict[str, Any] = {}
        self.is_closed = False

    async def request(self, subject: str, payload: bytes, timeout: float = 1.0,  # noqa: ASYNC109
                      headers: dict[str, str] | None = None) -> Any:
        if ".usage." in subject:  # usage records: an acked publish (JobContext.report)
            self.published.append((subject, payload))
            return SimpleNamespace(data=b'{"stream": "TG_USAGE", "seq": 1}', headers=None)
        if self.refusals:
            self.refusals -= 1
            self.order.append("refused")
            raise nats.errors.NoRespondersError
        self.stored.append((subject, payload, (headers or {}).get("Nats-Msg-Id", "")))
        self.order.append("stored")
        return SimpleNamespace(data=b'{"stream": "TG_STREAMLOG", "seq": 1}', headers=None)

    async def publish(self, subject: str, payload: bytes,
                      headers: dict[str, str] | None = None) -> None:
        self.published.append((subject, payload))

    def session(self) -> list[Any]:
        return [decode_session(p) for s, p in self.published if ".usage." not in s]

    def usage(self) -> list[UsageRecord]:
        return [UsageRecord.decode(p) for s, p in self.published if ".usage." in s]


@dataclass
class FakeStream:
    """``chunks`` one per read; then ``fail`` (raised) or, with ``hang``, a
    read that waits until closed; else the end (b"")."""

    chunks: list[bytes]
    usage: Usage = field(default_factory=lambda: Usage(5, 0, ""))
    fail: BackendError | None = None
    hang: bool = False
    reads: int = 0
    closed: bool = False
    _closed: asyncio.Event = field(default_factory=asyncio.Event)

    async def read(self, max_bytes: int) -> bytes:
        if self.reads < len(self.chunks):
            data = self.chunks[self.reads]
            self.reads += 1
            self.usage.completion_tokens += 1
            return data
        if self.fail is not None:
            raise self.fail
        if self.hang:
            await self._closed.wait()
            return b""
        self.usage.finish_reason = "stop"
        return b""

    async def aclose(self) -> None:
        self.closed = True
        self._closed.set()


class FakeBackend:
    def __init__(self, stream: FakeStream | None = None,
                 refuse: BackendError | None = None) -> None:
        self.stream, self.refuse, self.opened = stream, refuse, 0

    async def open(self, request: Request) -> FakeStream:
        self.opened += 1
        if self.refuse is not None:
            raise self.refuse
        assert self.stream is not None
        return self.stream

    async def aclose(self) -> None:
        pass


def make_job(backend: FakeBackend, msg: FakeMsg | None = None,
             window_msgs: int = 128) -> tuple[Job, FakeMsg, FakeNats]:
    now_ms = int(time.time() * 1000)
    request = Request(id="r1", reply=REPLY, model="m", api=Api.CHAT, stream=True, body={},
                      created_ms=now_ms, deadline_ms=now_ms + 60_000, window_bytes=1 << 20,
                      window_msgs=window_msgs, tenant="t", user="u", key_id="k")
    msg = msg or FakeMsg()
    nc = FakeNats()
    ctx = JobContext(config=CONFIG, nc=nc, control_subject="tg.ctl.w1")  # type: ignore[arg-type]
    return Job(msg, request, backend, ctx), msg, nc  # type: ignore[arg-type]


def kinds(nc: FakeNats) -> list[str]:
    return [type(m).__name__ for m in nc.session()]


def events(n: int) -> list[bytes]:
    return [b"data: {\"n\": %d}\n\n" % i for i in range(n)]


# -- the normal end ------------------------------------------------------------------


async def test_done_sends_head_chunks_done_reports_and_acks() -> None:
    stream = FakeStream(events(3))
    job, msg, nc = make_job(FakeBackend(stream))
    await asyncio.wait_for(job.run(), 5)
    sent = nc.session()
    assert kinds(nc) == ["Head", "Chunk", "Chunk", "Chunk", "Done"]
    assert [m.seq for m in sent] == [1, 2, 3, 4, 5]  # Head is 1, then one each
    head = sent[0]
    assert isinstance(head, Head)
    assert (head.control, head.job_seq) == ("tg.ctl.w1", 42)
    assert [m.data for m in sent[1:4] if isinstance(m, Chunk)] == events(3)
    done = sent[-1]
    assert isinstance(done, Done)
    assert (done.prompt_tokens, done.completion_tokens, done.finish_reason) == (5, 3, "stop")
    [record] = nc.usage()
    assert (record.id, record.outcome, record.tenant, record.user, record.key_id) == (
        "r1", "done", "t", "u", "k")
    assert (record.prompt_tokens, record.completion_tokens, record.attempt) == (5, 3, 1)
    assert record.reserved
    assert 0 < record.ttft_ms <= record.duration_ms
    assert msg.fate[-1:] == ["ack"]
    assert "nak" not in msg.fate
    assert stream.closed


# -- backend errors --------------------------------------------------------------------


async def test_backend_refusal_is_an_error_message_a_record_and_an_ack() -> None:
    refusal = BackendError(429, "slow down", type="rate_limit_error",
                           code="backend_rate_limited", retryable=True, retry_after=3.0)
    job, msg, nc = make_job(FakeBackend(refuse=refusal))
    await asyncio.wait_for(job.run(), 5)
    assert kinds(nc) == ["Head", "Error"]
    error = nc.session()[-1]
    assert isinstance(error, Error)
    assert (error.error.status, error.error.code, error.error.retryable,
            error.error.retry_after) == (429, "backend_rate_limited", True, 3.0)
    [record] = nc.usage()
    assert record.outcome == "error"
    assert record.ttft_ms == 0.0
    assert msg.fate == ["ack"]


async def test_backend_failure_mid_stream_ends_with_error_after_the_chunks() -> None:
    broken = BackendError(502, "connection broke", type="server_error", code="backend_error")
    stream = FakeStream(events(2), fail=broken)
    job, msg, nc = make_job(FakeBackend(stream))
    await asyncio.wait_for(job.run(), 5)
    assert kinds(nc) == ["Head", "Chunk", "Chunk", "Error"]
    error = nc.session()[-1]
    assert isinstance(error, Error)
    assert (error.error.code, error.error.retryable) == ("backend_error", False)
    [record] = nc.usage()
    assert (record.outcome, record.completion_tokens) == ("error", 2)
    assert msg.fate == ["ack"]
    assert stream.closed


# -- cancels -------------------------------------------------------------------------


async def start(job: Job) -> asyncio.Task[None]:
    task = asyncio.create_task(job.run())
    await eventually(lambda: job.task is not None, 2.0, "the job started")
    return task


async def test_client_cancel_reports_partial_usage_sends_nothing_and_acks() -> None:
    stream = FakeStream(events(2), hang=True)
    job, msg, nc = make_job(FakeBackend(stream))
    task = await start(job)
    await eventually(lambda: kinds(nc).count("Chunk") == 2, 2.0, "two chunks out")
    job.cancel("client_disconnected")
    await asyncio.wait_for(task, 5)
    assert not task.cancelled(), "a targeted cancel ends the job, not its task"
    assert kinds(nc)[-1] == "Chunk", "the edge asked: nothing more is sent"
    [record] = nc.usage()
    assert (record.outcome, record.completion_tokens) == ("cancelled", 2)
    assert msg.fate[-1] == "ack"
    assert "nak" not in msg.fate
    assert stream.closed, "the backend call is closed at once"


async def test_shutdown_before_any_chunk_hands_the_job_back() -> None:
    stream = FakeStream([], hang=True)  # a long prefill
    job, msg, nc = make_job(FakeBackend(stream))
    task = await start(job)
    await eventually(lambda: stream.closed or job.stream is not None, 2.0, "backend called")
    job.cancel(WORKER_SHUTDOWN)
    await asyncio.wait_for(task, 5)
    assert "Chunk" not in kinds(nc)
    assert "Error" not in kinds(nc)
    assert nc.usage() == [], "nothing ran to its end: the next worker reports"
    assert msg.fate[-1] == "nak"
    assert "ack" not in msg.fate
    assert stream.closed


async def test_shutdown_after_output_ends_with_retryable_worker_shutdown() -> None:
    stream = FakeStream(events(1), hang=True)
    job, msg, nc = make_job(FakeBackend(stream))
    task = await start(job)
    await eventually(lambda: "Chunk" in kinds(nc), 2.0, "a chunk out")
    job.cancel(WORKER_SHUTDOWN)
    await asyncio.wait_for(task, 5)
    error = nc.session()[-1]
    assert isinstance(error, Error)
    assert (error.error.status, error.error.code, error.error.retryable) == (
        503, "worker_shutdown", True)
    assert [r.outcome for r in nc.usage()] == ["cancelled"]
    assert msg.fate[-1] == "ack"
    assert "nak" not in msg.fate


async def test_cancelled_from_outside_leaves_the_message_for_redelivery() -> None:
    stream = FakeStream(events(1), hang=True)
    job, msg, nc = make_job(FakeBackend(stream))
    task = await start(job)
    await eventually(lambda: "Chunk" in kinds(nc), 2.0, "a chunk out")
    task.cancel()  # the worker process is going away, not this job
    with pytest.raises(asyncio.CancelledError):
        await task
    assert "ack" not in msg.fate
    assert "nak" not in msg.fate
    assert nc.usage() == []


# -- the edge goes quiet: ack timeout; the client is slow: backpressure ---------------


async def test_no_ack_for_the_ack_timeout_cancels_with_an_error_event() -> None:
    stream = FakeStream([], hang=True)
    job, msg, nc = make_job(FakeBackend(stream))
    started = time.monotonic()
    await asyncio.wait_for(job.run(), 5)
    took = time.monotonic() - started
    assert took >= CONFIG.session.ack_timeout
    assert "Heartbeat" in kinds(nc), "heartbeats while the backend is silent"
    assert all(isinstance(m, Heartbeat) for m in nc.session()[1:-1])
    error = nc.session()[-1]
    assert isinstance(error, Error)
    assert (error.error.code, error.error.retryable) == (ACK_TIMEOUT, True)
    assert [r.outcome for r in nc.usage()] == ["cancelled"]
    assert msg.fate[-1] == "ack"
    assert stream.closed


async def test_acks_keep_a_silent_job_alive() -> None:
    stream = FakeStream([], hang=True)
    job, _msg, _nc = make_job(FakeBackend(stream))
    task = await start(job)
    deadline = time.monotonic() + 2 * CONFIG.session.ack_timeout
    while time.monotonic() < deadline:  # a live edge acks every ack_timeout/4
        job.on_ack(1)
        await asyncio.sleep(CONFIG.session.ack_timeout / 4)
    assert not task.done(), "acked on time, yet cancelled"
    job.cancel("client_disconnected")
    await asyncio.wait_for(task, 5)


async def test_slow_client_window_stops_backend_reads_until_acked() -> None:
    stream = FakeStream(events(6))
    job, msg, nc = make_job(FakeBackend(stream), window_msgs=2)
    task = await start(job)
    await eventually(lambda: kinds(nc).count("Chunk") == 2, 2.0, "the window's two chunks")
    await eventually(lambda: not job._window_open.is_set(), 2.0, "the window is full")
    reads = stream.reads
    await asyncio.sleep(0)  # the job had its turn: it waits on the window, not the backend
    assert stream.reads == reads == 2, "read the backend past a full window"
    job.on_ack(job.seq)  # everything sent so far written to the client
    await eventually(lambda: kinds(nc).count("Chunk") == 4, 2.0, "two more after the ack")
    while not task.done():  # the client reads on: each ack lets the next two out
        job.on_ack(job.seq)
        await eventually(lambda: task.done() or not job._window_open.is_set(), 2.0,
                         "the window fills again or the job ends")
    await asyncio.wait_for(task, 5)
    assert kinds(nc)[-1] == "Done", nc.session()[-1]
    assert msg.fate[-1] == "ack"


# -- redelivery ------------------------------------------------------------------------


async def test_redelivered_job_without_its_edge_is_dropped_without_the_backend() -> None:
    backend = FakeBackend(FakeStream(events(3)))
    job, msg, nc = make_job(backend, FakeMsg(delivered=2))
    await asyncio.wait_for(job.run(), 5)
    assert kinds(nc) == ["Head"]
    head = nc.session()[0]
    assert isinstance(head, Head)
    assert head.attempt == 2
    assert backend.opened == 0
    [record] = nc.usage()
    assert (record.outcome, record.attempt, record.completion_tokens) == ("dropped", 2, 0)
    assert msg.fate[-1] == "ack"
    assert "nak" not in msg.fate


async def test_redelivered_job_its_edge_confirms_runs() -> None:
    backend = FakeBackend(FakeStream(events(2)))
    job, _msg, nc = make_job(backend, FakeMsg(delivered=3))
    task = await start(job)
    await eventually(lambda: kinds(nc) == ["Head"], 2.0, "Head of the redelivery")
    job.on_ack(0)  # the edge: still waiting, nothing received
    await asyncio.wait_for(task, 5)
    assert kinds(nc) == ["Head", "Chunk", "Chunk", "Done"]
    assert backend.opened == 1
    assert [(r.outcome, r.attempt) for r in nc.usage()] == [("done", 3)]


async def test_a_copy_another_owns_the_stream_of_ends_without_a_trace() -> None:
    """DUPLICATE_DELIVERY, mid-stream (a worker the edge took for dead and
    handed the job on from) and before the go-ahead (a second delivery while
    the first copy streams): the backend call closes, nothing more goes to the
    edge, no usage record, and the message is neither acked nor handed back."""
    stream = FakeStream(events(2), hang=True)
    job, msg, nc = make_job(FakeBackend(stream))
    task = await start(job)
    await eventually(lambda: kinds(nc).count("Chunk") == 2, 2.0, "two chunks out")
    job.cancel(DUPLICATE_DELIVERY)
    await asyncio.wait_for(task, 5)
    assert kinds(nc)[-1] == "Chunk"
    assert nc.usage() == []
    assert set(msg.fate) <= {"in_progress"}, msg.fate
    assert stream.closed

    backend = FakeBackend(FakeStream(events(2)))
    copy, msg, nc = make_job(backend, FakeMsg(delivered=2))
    task = await start(copy)
    await eventually(lambda: kinds(nc) == ["Head"], 2.0, "Head of the second delivery")
    copy.cancel(DUPLICATE_DELIVERY)
    await asyncio.wait_for(task, 5)
    assert kinds(nc) == ["Head"]
    assert backend.opened == 0
    assert nc.usage() == []
    assert set(msg.fate) <= {"in_progress"}, msg.fate


class LogOutbox:
    def __init__(self, order: list[str] | None = None) -> None:
        self.put_count = 0
        self.order = [] if order is None else order

    def put(self, subject: str, request_id: str, message: bytes) -> None:
        self.put_count += 1

    async def flush(self) -> None:
        self.order.append("flushed")


@pytest.mark.parametrize("refusals", [0, 2])
async def test_a_resumable_jobs_end_is_stored_again_with_an_ack(refusals: int) -> None:
    """Log entries are plain publishes, which JetStream drops without a word
    while the log's stream has no leader (a NATS node's death): a log that
    lost its end would leave every later reader waiting for its silence
    limit. The end goes once more as a publish that waits for its ack, after
    the outbox's flush (the plain entries first), again while "no
    responders", and deduplicated by its id."""
    now_ms = int(time.time() * 1000)
    request = Request(id="r1", reply=REPLY, model="m", api=Api.CHAT, stream=True, body={},
                      created_ms=now_ms, deadline_ms=now_ms + 60_000, window_bytes=1 << 20,
                      window_msgs=128, resumable=True)
    nc = FakeNats(refusals=refusals)
    outbox = LogOutbox(nc.order)
    ctx = JobContext(config=CONFIG, nc=nc, control_subject="tg.ctl.w1",  # type: ignore[arg-type]
                     log_outbox=outbox)  # type: ignore[arg-type]
    job = ResumableJob(FakeMsg(), request, FakeBackend(FakeStream(events(2))),  # type: ignore[arg-type]
                       ctx)
    await asyncio.wait_for(job.run(), 5)
    await eventually(lambda: nc.stored, 30.0, "the end stored")
    ((subject, payload, msg_id),) = nc.stored
    assert subject.endswith(".log.r1")
    end = decode_session(payload)
    assert isinstance(end, Done)
    assert end.seq == 4  # Head, 2 chunks, Done
    assert msg_id == "r1.1.4"
    assert nc.order == ["flushed", *["refused"] * refusals, "stored"]


async def test_a_resumable_copy_cancelled_during_its_log_read_still_ends_as_cancelled() -> None:
    """The edge's DUPLICATE_DELIVERY reaches a resumable copy while it reads
    its stream log, and the NATS client's request swallows the task's
    cancellation (seen once under load): the copy still ends without a
    trace, not dropped with a usage record and an ack, and its Head never
    reaches the log."""
    now_ms = int(time.time() * 1000)
    request = Request(id="r1", reply=REPLY, model="m", api=Api.CHAT, stream=True, body={},
                      created_ms=now_ms, deadline_ms=now_ms + 60_000, window_bytes=1 << 20,
                      window_msgs=128, resumable=True)
    msg, nc, outbox = FakeMsg(delivered=2), FakeNats(), LogOutbox()
    ctx = JobContext(config=CONFIG, nc=nc, control_subject="tg.ctl.w1",  # type: ignore[arg-type]
                     log_outbox=outbox)  # type: ignore[arg-type]
    backend = FakeBackend(FakeStream(events(2)))
    job = ResumableJob(msg, request, backend, ctx)  # type: ignore[arg-type]
    reading = asyncio.Event()

    async def swallowing_read() -> None:
        reading.set()
        with contextlib.suppress(asyncio.CancelledError):  # as the client's request did
            await asyncio.sleep(5)
        return None

    job._read_log = swallowing_read  # type: ignore[method-assign]
    task = await start(job)
    await asyncio.wait_for(reading.wait(), 2)
    job.cancel(DUPLICATE_DELIVERY)
    await asyncio.wait_for(task, 5)
    assert backend.opened == 0
    assert nc.usage() == []
    assert set(msg.fate) <= {"in_progress"}, msg.fate
    assert outbox.put_count == 0, "the copy's Head reached the log"


CONTINUING = tgconfig.from_dict({
    "session": {"heartbeat_interval": 0.1, "ack_timeout": 0.6, "worker_lost_after": 6},
    "worker": {"ack_wait": 0.3, "resume_timeout": 0.3},
    "models": [{"name": "m", "failover": "continue", "simulator": {}}],
})


@pytest.mark.parametrize("ended_here", [True, False])
async def test_a_copy_of_a_job_this_worker_ended_lately_does_not_continue_it(
        ended_here: bool) -> None:
    """A copy no edge speaks for (a background response) lands on the worker
    of the log's last Head: that worker no longer runs the job. If its own
    attempt ran to its end here (its tail ends with Done), the job is done
    and the copy must not continue the text after its end; if it was cut
    off, the copy continues the log."""
    now_ms = int(time.time() * 1000)
    request = Request(id="r1", reply=REPLY, model="m", api=Api.CHAT, stream=True,
                      body={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
                      created_ms=now_ms, deadline_ms=now_ms + 60_000, window_bytes=1 << 20,
                      window_msgs=128, resumable=True, extra={"background": True})
    own = "tg.ctl.w1"
    chunk = b'data: {"id":"chatcmpl-r1","choices":[{"index":0,"delta":{"content":"Hello"}}]}\n\n'
    tails = Tails(30.0)
    kept = [(2, Chunk(2, chunk).encode())]
    if ended_here:
        kept.append((3, Done(3, 1, 1, "stop").encode()))
    tails.keep(request, kept)
    msg, nc, outbox = FakeMsg(delivered=2), FakeNats(), LogOutbox()
    ctx = JobContext(config=CONTINUING, nc=nc, control_subject=own,  # type: ignore[arg-type]
                     log_outbox=outbox, tails=tails)  # type: ignore[arg-type]
    backend = FakeBackend(FakeStream(events(2)))
    job = ResumableJob(msg, request, backend, ctx)  # type: ignore[arg-type]
    cursor = LogCursor()
    for entry in (LogOpen("t", True, int(Api.CHAT), now_ms, 30.0), Head(1, own, 42, 1),
                  Chunk(2, chunk)):
        cursor.feed(entry)

    async def read_log() -> tuple[LogCursor, list[bytes]]:
        return cursor, [chunk]

    job._read_log = read_log  # type: ignore[method-assign,assignment]
    task = await start(job)
    await asyncio.wait_for(task, 5)
    assert backend.opened == (0 if ended_here else 1)


async def test_a_mux_job_is_acked_only_after_its_done_is_handed_to_nats() -> None:
    """A mux stream's messages wait in the outbox for a batch; the ack goes
    straight out. Acked first, a SIGKILL between the two lost the last chunks
    and the Done of a job JetStream never delivers again (its edge waited
    until its silence limit). The outbox here lingers 10 s, far past the
    job's end: only a flush before the ack sends the Done in time."""
    nc = FakeNats()
    outbox = Outbox(nc.publish, delay=10.0)
    outbox.start()
    now_ms = int(time.time() * 1000)
    request = Request(id="r1", reply=REPLY, model="m", api=Api.CHAT, stream=True, body={},
                      created_ms=now_ms, deadline_ms=now_ms + 60_000, window_bytes=1 << 20,
                      window_msgs=128, mux="tg.out.edge1.mux")
    msg = FakeMsg()
    published_at_ack: list[int] = []

    async def ack() -> None:
        published_at_ack.append(len(nc.published))
        msg.fate.append("ack")
    msg.ack = ack  # type: ignore[method-assign]
    ctx = JobContext(config=CONFIG, nc=nc, control_subject="tg.ctl.w1",  # type: ignore[arg-type]
                     outbox=outbox)
    job = Job(msg, request, FakeBackend(FakeStream(events(3))), ctx)  # type: ignore[arg-type]
    try:
        await asyncio.wait_for(job.run(), 5)
    finally:
        await outbox.close()
    assert msg.fate[-1] == "ack"
    batches = [p for s, p in nc.published[:published_at_ack[0]] if s == request.mux]
    assert batches, "the ack went out before any of the job's messages"
    sent = [m for batch in batches for _, m in decode_mux(batch)]
    assert [type(decode_session(m)).__name__ for m in sent][-1] == "Done"
