"""A worker's job under flow control (issue 42; the ends and the billing are
tests/test_job_rules.py): what it reads from its backend against the edge's
credit, the time it waited for it, what it sends again when the edge lost
messages, and the push path (a stream that hands chunks over from its socket
callback through the mux outbox), which only pipelines reached before.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from tests.poll import eventually
from tests.test_job_metrics import Observed
from tests.test_job_unit import CONFIG, FakeBackend, FakeStream, events, kinds, make_job, start
from tests.test_replica_continuation import BROKEN
from tidegate.errors import BackendError
from tidegate.wire.protocol import Chunk, Error, decode_session
from workers.backends import Usage
from workers.job import Job
from workers.job_context import JobContext

MUX = "tg.out.edge1.mux"


class Outbox:
    """tidegate.wire.mux.Outbox: what was put, and for whom."""

    def __init__(self) -> None:
        self.puts: list[tuple[str, str, bytes]] = []

    def put(self, subject: str, request_id: str, message: bytes) -> None:
        self.puts.append((subject, request_id, message))

    async def flush(self) -> None:
        pass

    def session(self) -> list[Any]:
        assert all(p[:2] == (MUX, "r1") for p in self.puts), self.puts
        return [decode_session(p[2]) for p in self.puts]


def muxed(job: Job) -> Outbox:
    outbox = Outbox()
    job.request = dataclasses.replace(job.request, mux=MUX)
    job.ctx = dataclasses.replace(job.ctx, outbox=outbox)  # type: ignore[arg-type]
    job.outbox = outbox  # type: ignore[assignment]
    return outbox


class Push:
    """A PushStream: hands its chunks to the sink while it has credit, waits
    for resume() when it has none, then ends (with ``fail``), twice."""

    def __init__(self, chunks: list[bytes], fail: BackendError | None = None) -> None:
        self.chunks, self.fail = list(chunks), fail
        self.usage = Usage(5, 0, "")
        self.sink: Any = None
        self.closed = False

    def start(self, sink: Any) -> None:
        self.sink = sink
        asyncio.get_running_loop().call_soon(self.resume)

    def resume(self) -> None:
        while self.chunks and self.sink.credit() > 0:
            self.sink.data(self.chunks.pop(0))
            self.usage.completion_tokens += 1
        if not self.chunks:
            self.usage.finish_reason = "stop"
            self.sink.end(self.fail)
            self.sink.end(None)  # a second end changes nothing

    async def read(self, max_bytes: int) -> bytes:
        raise AssertionError("a pushed stream is never read")

    async def aclose(self) -> None:
        self.closed = True


async def test_a_pushed_stream_reaches_the_edge_in_order_and_ends() -> None:
    stream = Push(events(3))
    job, msg, _ = make_job(FakeBackend(stream))  # type: ignore[arg-type]
    outbox = muxed(job)
    await asyncio.wait_for(job.run(), 5)
    sent = outbox.session()
    assert [type(m).__name__ for m in sent] == ["Head", "Chunk", "Chunk", "Chunk", "Done"]
    assert [m.seq for m in sent] == [1, 2, 3, 4, 5]
    assert [m.data for m in sent if isinstance(m, Chunk)] == events(3)
    assert msg.fate[-1] == "ack"
    assert stream.closed
    job.on_ack(job.seq)  # the edge acks the end after the push ended: nothing to resume


async def test_a_pushed_stream_that_fails_ends_with_its_error() -> None:
    job, msg, _ = make_job(FakeBackend(Push(events(1), fail=BROKEN)))  # type: ignore[arg-type]
    outbox = muxed(job)
    await asyncio.wait_for(job.run(), 5)
    sent = outbox.session()
    assert [type(m).__name__ for m in sent] == ["Head", "Chunk", "Error"]
    assert isinstance(sent[-1], Error)
    assert sent[-1].error.code == BROKEN.code
    assert msg.fate[-1] == "ack"


async def test_a_pushed_stream_waits_for_credit_and_counts_the_wait() -> None:
    observed = Observed()
    job, _, _ = make_job(FakeBackend(Push(events(5))), window_msgs=2)  # type: ignore[arg-type]
    job.ctx = dataclasses.replace(job.ctx, telemetry=observed.telemetry)
    outbox = muxed(job)
    task = await start(job)
    for n in (2, 4):
        await eventually(lambda n=n: len(outbox.puts) == 1 + n, 2.0, f"{n} chunks out")
        await asyncio.sleep(0.05)
        assert len(outbox.puts) == 1 + n, "pushed past the window"
        job.on_ack(job.seq)
    await asyncio.wait_for(task, 5)
    assert [type(m).__name__ for m in outbox.session()][-1] == "Done"
    assert 0.1 <= job.stall_time < 30, job.stall_time
    points = observed.points("tidegate.flow.stall.duration")
    assert [p.count for p in points] == [2]
    assert points[0].sum == job.stall_time
    assert dict(points[0].attributes)["gen_ai.request.model"] == "m"
    stalled = job.stall_time
    job.on_ack(job.seq)  # the window was not full: no wait to count
    assert job.stall_time == stalled


async def test_a_pumped_stream_goes_through_the_outbox_and_the_log() -> None:
    job, _, _ = make_job(FakeBackend(FakeStream(events(2))))
    outbox = muxed(job)
    logged: list[bytes] = []
    job._log_put = logged.append
    await asyncio.wait_for(job.run(), 5)
    assert [type(m).__name__ for m in outbox.session()] == ["Head", "Chunk", "Chunk", "Done"]
    assert logged == [p[2] for p in outbox.puts[1:3]], "every chunk to the log too"


# -- a pumped stream: reads within the window, and the wait ---------------------------------


class Sized(FakeStream):
    asked: list[int] = []

    async def read(self, max_bytes: int) -> bytes:
        self.asked.append(max_bytes)
        return await super().read(max_bytes)


async def test_a_read_asks_no_more_than_the_window_holds() -> None:
    stream = Sized([b"x" * 10, b"y" * 10])
    stream.asked = []
    job, _, nc = make_job(FakeBackend(stream))
    job.window.max_bytes = 25
    await asyncio.wait_for(job.run(), 5)
    assert stream.asked[:3] == [25, 15, 5]
    assert kinds(nc)[-1] == "Done"
    assert CONFIG.worker.read_bytes > 25


async def test_a_window_of_one_message_stops_the_reads_and_counts_each_wait() -> None:
    stream = FakeStream(events(3))
    job, _, nc = make_job(FakeBackend(stream), window_msgs=1)
    task = await start(job)
    for n in (1, 2, 3):
        await eventually(lambda n=n: kinds(nc).count("Chunk") == n, 2.0, f"chunk {n}")
        await asyncio.sleep(0.05)
        assert stream.reads == n, "read the backend past a full window"
        job.on_ack(job.seq)
    await asyncio.wait_for(task, 5)
    assert kinds(nc)[-1] == "Done"
    assert 0.1 <= job.stall_time < 30, job.stall_time


# -- retransmits ---------------------------------------------------------------------------


async def test_a_retransmit_sends_every_kept_message_from_its_seq_again() -> None:
    job, _, nc = make_job(FakeBackend(FakeStream(events(3), hang=True)))
    task = await start(job)
    await eventually(lambda: kinds(nc).count("Chunk") == 3, 2.0, "three chunks out")
    job.on_ack(2)  # the Head and the first chunk written
    before = list(nc.published)
    await job.on_retransmit(3)
    again = nc.published[len(before):]
    assert again == [(s, p) for s, p in before if decode_session(p).seq >= 3]
    assert [decode_session(p).seq for _, p in again][:2] == [3, 4]
    await job.on_retransmit(job.seq + 1)
    assert len(nc.published) == len(before) + len(again), "nothing kept from there"
    job.cancel("client_disconnected")
    await asyncio.wait_for(task, 5)


async def test_a_retransmit_of_a_mux_stream_goes_through_the_outbox() -> None:
    job, _, nc = make_job(FakeBackend(FakeStream(events(2), hang=True)))
    outbox = muxed(job)
    job.ctx = JobContext(config=job.ctx.config, nc=job.ctx.nc, control_subject="tg.ctl.w1",
                         outbox=outbox)  # type: ignore[arg-type]
    task = await start(job)
    await eventually(lambda: len(outbox.puts) >= 3, 2.0, "Head and two chunks out")
    before = list(outbox.puts)
    await job.on_retransmit(2)
    assert outbox.puts[len(before):][:2] == before[1:3]
    assert nc.published == [], "a mux stream's messages go through its outbox only"
    job.cancel("client_disconnected")
    await asyncio.wait_for(task, 5)
