"""workers/resumable.py's rules with fakes behind its seams: what a resumable
job writes to its stream log, when it stops waiting for one reader's acks and
when its readers' grace ends it (redelivered copies: test_resumable_copies).

The fakes are tests/test_job_unit.py's; here the NATS client and the log
outbox also wake the test on every message (:class:`Changes`), so a test
awaits what it depends on instead of polling a clock. A test of something
that must *not* happen waits for the loop's due timers (:func:`timers_due`),
never for a duration. Found by mutation testing (docs/testing.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from tests.test_job_unit import (
    REPLY,
    FakeBackend,
    FakeMsg,
    FakeNats,
    FakeStream,
    LogOutbox,
    events,
)
from tidegate import config as tgconfig
from tidegate.wire import streamlog
from tidegate.wire.protocol import (
    Api,
    Chunk,
    Error,
    ErrorInfo,
    Head,
    Request,
    decode_session,
)
from workers import resumable
from workers.backends import Sink, Usage
from workers.job_context import JobContext
from workers.resumable import LOG_FULL, ResumableJob
from workers.tails import Tails


def configured(failover: str = "continue", **sections: dict[str, Any]) -> tgconfig.Config:
    """Heartbeats, the ack timeout and readers' leases far off unless a test
    sets them: a loaded machine never reaches them."""
    base: dict[str, Any] = {
        "session": {"heartbeat_interval": 30, "ack_timeout": 600, "worker_lost_after": 6,
                    "liveness_interval": 0.5},
        "worker": {"ack_wait": 30, "resume_timeout": 0.05},
        "resume": {"attach_interval": 600},
        "models": [{"name": "m", "failover": failover, "simulator": {}}],
    }
    for name, values in sections.items():
        base[name] = {**base.get(name, {}), **values}
    return tgconfig.from_dict(base)


QUIET = configured()
OWN = "tg.ctl.w1"  # this worker's control subject
OTHER = "tg.ctl.w2"  # another worker's, which ran the job before
CHAT_BODY: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                             "max_tokens": 10}


class Changes:
    """Wakes a test at each message the fakes record."""

    def __init__(self) -> None:
        self._event = asyncio.Event()

    def note(self) -> None:
        self._event.set()

    async def until(self, ready: Callable[[], bool]) -> None:
        while not ready():
            self._event.clear()
            await self._event.wait()


async def timers_due() -> None:
    """Until the loop ran every timer due by now (a grace of 0, a
    ``call_soon``): timers run in the order they fall due, and this one is
    set after them."""
    ran = asyncio.Event()
    asyncio.get_running_loop().call_later(0, ran.set)
    await ran.wait()


class EdgeNats(FakeNats):
    """The job's NATS client, and its edge's word: ``answer`` runs when the
    job's Head goes out (an edge answers a redelivered copy's Head)."""

    def __init__(self, changes: Changes) -> None:
        super().__init__()
        self.changes = changes
        self.answer: Callable[[], None] | None = None

    async def publish(self, subject: str, payload: bytes,
                      headers: dict[str, str] | None = None) -> None:
        await super().publish(subject, payload, headers)
        if self.answer is not None and isinstance(decode_session(payload), Head):
            self.answer()
        self.changes.note()


class Recorder(LogOutbox):
    """An outbox (the log's, or a mux edge's) that keeps what was put."""

    def __init__(self, changes: Changes) -> None:
        super().__init__()
        self.changes = changes
        self.puts: list[tuple[str, str, bytes]] = []

    def put(self, subject: str, request_id: str, message: bytes) -> None:
        super().put(subject, request_id, message)
        self.puts.append((subject, request_id, message))
        self.changes.note()

    def messages(self) -> list[Any]:
        return [decode_session(m) for _, _, m in self.puts]

    def kinds(self) -> list[str]:
        return [type(m).__name__ for m in self.messages()]


class Backend(FakeBackend):
    """Keeps the requests it was opened with (a continuation's body)."""

    def __init__(self, stream: Any) -> None:
        super().__init__(stream)
        self.requests: list[Request] = []

    async def open(self, request: Request) -> Any:
        self.requests.append(request)
        return await super().open(request)


@dataclass
class Rig:
    job: ResumableJob
    msg: FakeMsg
    nc: EdgeNats
    log: Recorder
    edge: Recorder  # a mux edge's outbox (unused without mux)
    backend: Backend
    changes: Changes

    def sent(self) -> list[Any]:
        """What the job sent its edge, in order (the reply path or the mux outbox)."""
        return self.nc.session() + self.edge.messages()

    def kinds(self) -> list[str]:
        return [type(m).__name__ for m in self.sent()]


def rig(config: tgconfig.Config = QUIET, *, stream: Any = None, delivered: int = 1,
        window_msgs: int = 128, grace: float = 3600.0, api: Api = Api.CHAT,
        body: dict[str, Any] | None = None, extra: dict[str, Any] | None = None,
        mux: bool = False, tails: Tails | None = None) -> Rig:
    changes = Changes()
    now_ms = int(time.time() * 1000)
    request = Request(id="r1", reply=REPLY, model="m", api=api, stream=True,
                      body=CHAT_BODY if body is None else body, created_ms=now_ms,
                      deadline_ms=now_ms + 600_000, window_bytes=1 << 20,
                      window_msgs=window_msgs, tenant="t", user="u", key_id="k",
                      mux="tg.out.edge1.mux" if mux else "", extra=extra or {},
                      resumable=True, grace=grace)
    nc, log, edge = EdgeNats(changes), Recorder(changes), Recorder(changes)
    backend = Backend(FakeStream(events(3)) if stream is None else stream)
    ctx = JobContext(config=config, nc=nc, control_subject=OWN,  # type: ignore[arg-type]
                     outbox=edge, log_outbox=log, tails=tails)  # type: ignore[arg-type]
    msg = FakeMsg(delivered=delivered)
    job = ResumableJob(msg, request, backend, ctx)  # type: ignore[arg-type]
    return Rig(job, msg, nc, log, edge, backend, changes)


@contextlib.asynccontextmanager
async def running(r: Rig) -> AsyncIterator[asyncio.Task[None]]:
    """The job as its worker runs it; whatever is left of it is stopped after."""
    task = asyncio.create_task(r.job.run())
    try:
        yield task
    finally:
        r.job.release()  # its grace timer
        if not task.done():
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def stalled(r: Rig) -> bool:
    """The job waits for its edge's acks (its window is full)."""
    return not r.job._window_open.is_set()


def stored_ends(before: set[asyncio.Task[None]]) -> set[asyncio.Task[None]]:
    """The acked re-publishes of log ends scheduled since ``before``."""
    return resumable._ending - before


# -- the log ---------------------------------------------------------------------


async def test_the_log_holds_every_message_its_edge_got_head_first() -> None:
    r = rig()
    before = set(resumable._ending)
    await r.job.run()
    assert r.kinds() == ["Head", "Chunk", "Chunk", "Chunk", "Done"]
    sent = [p for s, p in r.nc.published if ".usage." not in s]
    assert [m for _, _, m in r.log.puts] == sent, "the log differs from what the edge got"
    subject = streamlog.subject(QUIET.nats.subjects, "r1")
    assert {(s, i) for s, i, _ in r.log.puts} == {(subject, "r1")}
    # The end once more, as an acked publish; once stored it is no longer waited for.
    storing = stored_ends(before)
    assert len(storing) == 1
    await asyncio.gather(*storing)
    assert [(s, p) for s, p, _ in r.nc.stored] == [(subject, sent[-1])]
    assert not storing & resumable._ending, "a stored end is still waited for at drain"


async def _sizes() -> list[int]:
    """The sizes of a plain run's log messages (Head, 3 chunks, Done)."""
    r = rig()
    await r.job.run()
    return [len(m) for _, _, m in r.log.puts]


async def test_a_log_of_exactly_its_budget_keeps_everything_and_its_end() -> None:
    config = configured(resume={"max_stream_bytes": sum(await _sizes())})
    r = rig(config)
    before = set(resumable._ending)
    await r.job.run()
    assert r.log.kinds() == ["Head", "Chunk", "Chunk", "Chunk", "Done"]
    storing = stored_ends(before)
    assert storing, "a log that kept its end did not store it again"
    await asyncio.gather(*storing)


FULL = ErrorInfo(502, "server_error", LOG_FULL, "This stream outgrew its resume log "
                 "(resume.max_stream_bytes); it cannot be resumed past this point.",
                 False, 0.0)


async def test_past_its_budget_the_log_ends_with_resume_log_full_and_the_client_reads_on(
        ) -> None:
    """Head and the first chunk fill the budget exactly: the second chunk's
    place in the log takes the LOG_FULL error, which ends it (nothing after,
    no acked re-publish of an end that is not logged). The client still
    reading gets the whole answer."""
    sizes = await _sizes()
    r = rig(configured(resume={"max_stream_bytes": sizes[0] + sizes[1]}))
    before = set(resumable._ending)
    await r.job.run()
    assert r.kinds() == ["Head", "Chunk", "Chunk", "Chunk", "Done"]
    logged = r.log.messages()
    assert [type(m).__name__ for m in logged] == ["Head", "Chunk", "Error"]
    end = logged[-1]
    assert isinstance(end, Error)
    assert end.seq == 3, "the error takes the seq of the chunk it replaces"
    assert end.error == FULL
    assert not stored_ends(before)
    assert [u.outcome for u in r.nc.usage()] == ["done"]


@pytest.mark.parametrize("detached", [True, False])
async def test_a_full_log_ends_a_job_nobody_reads_live(detached: bool) -> None:
    """Past the budget, a job whose client left has nothing left to write
    to: it is cancelled (LOG_FULL, no error after the log's). One whose
    client still reads goes on."""
    sizes = await _sizes()
    r = rig(configured(resume={"max_stream_bytes": sizes[0] + sizes[1]}),
            stream=FakeStream(events(3), hang=True))
    if detached:
        r.job.on_attach("reader")  # a reader of the log, so no grace
        r.job.on_detach("")
    async with running(r) as task:
        await r.changes.until(lambda: "Error" in r.log.kinds())
        await timers_due()
        if not detached:
            assert r.job.cancel_reason == ""
            return
        assert r.job.cancel_reason == LOG_FULL
        await task
    assert r.kinds()[-1] == "Chunk", "an error after the log's own"
    assert [u.outcome for u in r.nc.usage()] == ["cancelled"]
    assert r.msg.fate[-1] == "ack"


async def test_a_client_that_leaves_a_full_log_ends_its_job_at_once() -> None:
    """The log filled while the client read live (the job went on for it);
    once it leaves, nothing it generates can reach anyone, reader or resume:
    cancelled with LOG_FULL, not after the readers' grace (an hour here)."""
    sizes = await _sizes()
    r = rig(configured(resume={"max_stream_bytes": sizes[0] + sizes[1]}),
            stream=FakeStream(events(3), hang=True))
    async with running(r) as task:
        await r.changes.until(lambda: "Error" in r.log.kinds())
        await timers_due()
        assert r.job.cancel_reason == ""  # still read live
        r.job.on_detach("")
        await timers_due()
        assert r.job.cancel_reason == LOG_FULL
        await task
    assert [u.outcome for u in r.nc.usage()] == ["cancelled"]


# -- readers: bound by one reader's acks, or not ----------------------------------


async def test_while_its_client_reads_the_window_holds_output_until_acked() -> None:
    r = rig(stream=FakeStream(events(4)), window_msgs=2)
    async with running(r) as task:
        await r.changes.until(lambda: task.done() or stalled(r))
        assert stalled(r), "a job whose client reads ran past its window"
        assert r.kinds() == ["Head", "Chunk", "Chunk"]


async def test_a_background_response_generates_to_its_end_without_acks() -> None:
    r = rig(stream=FakeStream(events(5)), window_msgs=2, extra={"background": True})
    async with running(r) as task:
        await r.changes.until(lambda: task.done() or stalled(r))
        assert task.done(), "a background response waited for a reader's acks"
    assert r.kinds() == ["Head", *["Chunk"] * 5, "Done"]
    assert r.log.kinds() == r.kinds()


async def test_once_its_client_left_nothing_is_kept_for_a_retransmit() -> None:
    """The log holds the output: the worker keeps none of it in memory (nor
    hands it to its tails at the end), and an old edge's retransmit gets
    nothing."""
    r = rig(stream=FakeStream(events(4), hang=True))
    r.job.on_attach("reader")
    r.job.on_detach("")
    async with running(r):
        await r.changes.until(lambda: r.kinds().count("Chunk") == 4)
        assert r.job.window.kept() == []
        published = len(r.nc.published)
        await r.job.on_retransmit(1)
        assert len(r.nc.published) == published


async def test_an_edge_silent_past_the_ack_timeout_is_a_client_gone_not_a_cancel() -> None:
    """No ack for the ack timeout: the job goes on into its log, past its
    window, and its watchdog goes on (heartbeats for the log's readers
    through a silent backend)."""
    config = configured(session={"heartbeat_interval": 0.05, "ack_timeout": 0.2},
                     worker={"ack_wait": 0.2})
    r = rig(config, stream=FakeStream(events(3), hang=True), window_msgs=2)

    def heartbeats_after_the_last_chunk() -> int:
        kinds = r.log.kinds()
        if kinds.count("Chunk") < 3:
            return 0
        return kinds[len(kinds) - kinds[::-1].index("Chunk"):].count("Heartbeat")

    async with running(r):
        await r.changes.until(lambda: heartbeats_after_the_last_chunk() >= 3)
        assert "Error" not in r.kinds()
        assert r.job.cancel_reason == ""


@dataclass
class PushedStream:
    """A push stream (workers.backends.PushStream): hands its chunks to the
    sink while it has credit, then holds until ``resume``."""

    chunks: list[bytes]
    usage: Usage = field(default_factory=lambda: Usage(5, 0, ""))
    sink: Sink | None = None
    resumes: int = 0
    closed: bool = False

    def start(self, sink: Sink) -> None:
        self.sink = sink
        self._pump()

    def resume(self) -> None:
        self.resumes += 1
        self._pump()

    def _pump(self) -> None:
        sink = self.sink
        assert sink is not None
        while self.chunks and sink.credit() > 0:
            sink.data(self.chunks.pop(0))
            self.usage.completion_tokens += 1
        if not self.chunks:
            self.usage.finish_reason = "stop"
            sink.end(None)

    async def read(self, max_bytes: int) -> bytes:
        raise AssertionError("a pushed stream is not read")

    async def aclose(self) -> None:
        self.closed = True


async def test_a_pushed_stream_stalled_on_its_window_resumes_when_its_client_leaves() -> None:
    """The push path (``data``): every chunk to the edge's mux outbox and to
    the log. A stream stalled on a full window goes on once the client
    leaves, and the stall is counted once, as long as it lasted."""
    stream = PushedStream(events(5))
    r = rig(stream=stream, window_msgs=2, mux=True)
    started = time.monotonic()
    async with running(r) as task:
        await r.changes.until(lambda: task.done() or stalled(r))
        assert r.edge.kinds() == ["Head", "Chunk", "Chunk"]
        r.job.on_detach("")
        assert stream.resumes == 1, "the stream was not resumed"
        assert not stream.chunks
        stall = r.job.stall_time
        assert 0.0 <= stall <= time.monotonic() - started
        r.job.on_attach("reader")  # unbound again: no second stall
        assert r.job.stall_time == stall
        await task
    assert r.edge.kinds() == ["Head", *["Chunk"] * 5, "Done"]
    assert {(s, i) for s, i, _ in r.edge.puts} == {("tg.out.edge1.mux", "r1")}
    chunks = [m for m in r.edge.messages() if isinstance(m, Chunk)]
    assert [c.data for c in chunks] == events(5)
    assert [m for _, _, m in r.log.puts] == [m for _, _, m in r.edge.puts]


# -- readers and their grace --------------------------------------------------------

ABANDONED = "stream_abandoned"


async def _streaming(r: Rig) -> None:
    await r.changes.until(lambda: "Chunk" in r.kinds())


async def test_the_last_reader_gone_ends_the_stream_after_its_grace() -> None:
    r = rig(stream=FakeStream(events(1), hang=True), grace=0.0)
    async with running(r) as task:
        await _streaming(r)
        r.job.on_attach("reader")
        r.job.on_detach("")  # its client left; a reader reads the log
        r.job.on_detach("reader")
        await timers_due()
        assert r.job.cancel_reason == "resume_grace"
        await task
    for messages in (r.sent(), r.log.messages()):
        end = messages[-1]
        assert isinstance(end, Error)
        assert end.error.code == ABANDONED
    assert [u.outcome for u in r.nc.usage()] == ["cancelled"]
    assert r.msg.fate[-1] == "ack"


async def test_a_reader_back_within_the_grace_keeps_the_stream_until_it_leaves() -> None:
    r = rig(stream=FakeStream(events(1), hang=True), grace=0.0)
    async with running(r):
        await _streaming(r)
        r.job.on_detach("")  # nobody: the grace starts...
        r.job.on_attach("reader")  # ... and ends with a reader back
        await timers_due()
        assert r.job.cancel_reason == ""
        r.job.on_detach("reader")  # and starts again
        await timers_due()
        assert r.job.cancel_reason == "resume_grace"


async def test_while_its_client_reads_no_grace_runs() -> None:
    r = rig(stream=FakeStream(events(1), hang=True), grace=0.0)
    async with running(r):
        await _streaming(r)
        r.job.on_attach("reader")
        r.job.on_detach("reader")
        r.job.on_detach("reader")  # again (its edge's Detach after its lease ran out)
        r.job.on_detach("never-attached")
        await timers_due()
        assert r.job.cancel_reason == ""


async def test_a_job_that_never_lost_its_client_is_released() -> None:
    r = rig()
    await r.job.run()
    r.job.release()


async def test_a_reader_not_heard_from_for_three_attach_intervals_is_gone() -> None:
    r = rig(configured(resume={"attach_interval": 2.0}))
    r.job.on_attach("reader")
    seen = r.job.readers["reader"]
    r.job._on_tick(seen + 5.99)
    assert "reader" in r.job.readers
    r.job._on_tick(seen + 6.01)
    assert "reader" not in r.job.readers


async def test_the_last_readers_lease_running_out_starts_the_grace() -> None:
    r = rig(stream=FakeStream(events(1), hang=True), grace=0.0)
    async with running(r) as task:
        await _streaming(r)
        r.job.on_attach("reader")
        r.job.on_detach("")
        await timers_due()
        assert r.job.cancel_reason == ""
        r.job._on_tick(r.job.readers["reader"] + 3 * 600 + 1)
        await timers_due()
        assert r.job.cancel_reason == "resume_grace"
        await task


# -- the ends being stored, at drain ------------------------------------------------


async def test_a_draining_worker_waits_for_the_logs_ends_being_stored(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(resumable, "_ending", set())
    stored = asyncio.Event()
    task = asyncio.create_task(stored.wait())
    resumable._keep(task)  # type: ignore[arg-type]
    asyncio.get_running_loop().call_soon(stored.set)
    await resumable.ends_stored(3600)
    assert task.done()
    assert not resumable._ending


async def test_a_draining_worker_waits_for_the_ends_no_longer_than_told(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(resumable, "_ending", set())
    task = asyncio.create_task(asyncio.Event().wait())
    resumable._keep(task)  # type: ignore[arg-type]
    try:
        await resumable.ends_stored(0.0)
        assert not task.done()
    finally:
        task.cancel()
