"""The relay's per-batch and per-tick rules (edge.relay.Relay), unit, no
socket: what a client, a worker and an operator see of each.

| rule | who sees it |
| --- | --- |
| a heartbeat alone is a ``: ping``; a quiet stream pings at its heartbeat | the client |
| a batch's acks count its messages and bytes; a copy is acked again, once | the worker's window |
| a tick acks what was written, the direct path's too; a reconnect asks at once | the worker |
| admission: a queue note only to a queued stream; a resumable one starts at once | the client |
| a rejection ends with its own error and cancels nothing | the client, the metrics |
| what the client got, by either path, is what the next worker and the log get | the client |
| dropped input is counted as session input, a slow client by its reason | the metrics |

Found by mutation testing (docs/testing.md): each test fails on a mutant of
edge/relay.py that the other relay tests let pass.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest

import edge.relay as relay_module
from edge import instrument
from edge.continuation import FOLD_AT
from edge.endings import SlowClient
from edge.relay import Relay, RelayContext
from edge.session import Session
from edge.stream import Phase
from tests.test_relay_direct import RecordingPublisher, event, make_request, wait_for
from tests.test_relay_ends import Log, Recorded, recorded, running
from tests.test_relay_heads import JOB_ACK, W1, W2, chunk, dies, relay, sent
from tests.test_writers import RecordingWriter
from tidegate.broker.link import Link
from tidegate.config import Config
from tidegate.errors import ApiError
from tidegate.wire.flow import first_seq
from tidegate.wire.protocol import (
    Ack,
    Admission,
    Api,
    Cancel,
    Chunk,
    Continue,
    Done,
    ErrorInfo,
    Head,
    Heartbeat,
    Retransmit,
    SessionMessage,
    Status,
)
from tidegate.wire.streamlog import LiveTail

PING = (b": ping\n\n", False)


def acks(publisher: RecordingPublisher) -> list[int]:
    """The seqs of the acks published so far (and forget them)."""
    return [m.seq for _, m in sent(publisher) if isinstance(m, Ack)]


async def streaming(publisher: RecordingPublisher, *, stream: bool = True,
                    resumable: bool = False) -> tuple[Relay, Recorded]:
    """A relay past W1's Head, writing into a recorder, nothing published yet."""
    r = relay(publisher, stream=stream, resumable=resumable)
    out = recorded(r)
    await r._on_head(Head(1, W1, 7, 1, JOB_ACK))
    publisher.published.clear()
    return r, out


class Drops:
    """BAD_INPUT, recorded: (kind, reason) are the metric's labels."""

    def __init__(self) -> None:
        self.dropped: list[tuple[str, str]] = []

    def drop(self, kind: str, reason: str, detail: str = "") -> None:
        self.dropped.append((kind, reason))


@pytest.fixture
def drops(monkeypatch: pytest.MonkeyPatch) -> Drops:
    recorder = Drops()
    monkeypatch.setattr(relay_module, "BAD_INPUT", recorder)
    return recorder


# -- pings -------------------------------------------------------------------


async def test_a_heartbeat_alone_is_a_ping_to_a_stream_and_nothing_to_a_body() -> None:
    """docs/lifecycle.md: ``: ping`` when a batch brought a heartbeat and no
    chunk."""
    r, out = await streaming(RecordingPublisher())
    assert await r._handle([Heartbeat(2)], time.monotonic()) is False
    assert out.writes == [PING]
    plain, plain_out = await streaming(RecordingPublisher(), stream=False)
    await plain._handle([Heartbeat(2)], time.monotonic())
    assert plain_out.writes == []
    assert plain.expected_seq == 3


async def test_a_quiet_stream_pings_at_its_heartbeat() -> None:
    """A stream with nothing to send keeps its connection alive (proxies)."""
    r, out = await streaming(RecordingPublisher())
    await r._on_tick(r.last_write + r.ctx.config.session.heartbeat_interval)
    assert out.writes == [PING]


# -- acks --------------------------------------------------------------------


async def test_a_batch_counts_each_of_its_messages_and_a_copy_is_acked_again_once() -> None:
    """The worker's window counts messages: a batch of half a window of them
    is acked at once. A copy of one taken (the worker resent what it holds
    unacked) gets the last ack again, and the next batch does not."""
    publisher = RecordingPublisher()
    r, _ = await streaming(publisher)
    half = r.request.window_msgs // 2
    now = time.monotonic()
    await r._handle([Chunk(seq, event(seq)) for seq in range(2, 2 + half)], now)
    assert acks(publisher) == [half + 1]
    await r._handle([Chunk(3, event(3))], now)
    assert acks(publisher) == [half + 1]
    await r._handle([Chunk(half + 2, event(half + 2))], now)
    assert acks(publisher) == []


async def test_an_ack_is_due_at_half_the_window_in_bytes_and_not_a_byte_before() -> None:
    """Bytes count as messages do: an early ack is credit the worker's window
    was not given."""
    publisher = RecordingPublisher()
    r, _ = await streaming(publisher)
    half = r.request.window_bytes // 2
    batch: list[SessionMessage] = [Chunk(2, event(0, size=half // 2)),
                                   Chunk(3, event(1, size=half - half // 2 - 1))]
    await r._handle(batch, time.monotonic())
    assert acks(publisher) == []
    await r._handle([Chunk(4, b"\n")], time.monotonic())
    assert acks(publisher) == [4]


async def test_a_tick_acks_what_was_written_and_the_ack_timer_restarts() -> None:
    """A worker in a long prefill, or with slow output, learns every quarter
    of session.ack_timeout that this edge is alive, and how far it wrote."""
    publisher = RecordingPublisher()
    r, _ = await streaming(publisher)
    await r._handle([Chunk(2, event(0))], time.monotonic())
    assert acks(publisher) == []
    due = r.last_ack + r.ctx.config.session.ack_timeout / 4
    await r._on_tick(due)
    assert acks(publisher) == [2]
    await r._on_tick(due)  # acked just now: not again
    assert sent(publisher) == []


async def test_a_direct_write_moves_the_clocks_and_is_acked_by_the_next_tick() -> None:
    """The direct path (NATS callback) hands its writer the time of the
    write (a WebSocket's keepalive reads it) and counts for the silence
    rule and the acks as the relay's own writes do."""
    publisher = RecordingPublisher()
    r, _ = await streaming(publisher)
    written: list[tuple[bytes, float]] = []

    def raw(data: bytes, now: float) -> bool:
        written.append((data, now))
        return True

    r.raw = raw
    assert r._direct(Chunk(2, event(0)))
    [(data, now)] = written
    assert data == event(0)
    assert isinstance(now, float)
    assert r.last_write == r.last_worker_msg == now
    await r._on_tick(r.last_ack + r.ctx.config.session.ack_timeout / 4)
    assert acks(publisher) == [2]


class Reconnecting:
    """A NATS client that is up, and counts its reconnects as nats-py does."""

    is_connected = True
    is_closed = False

    def __init__(self) -> None:
        self.stats = {"reconnects": 0}


async def test_a_reconnect_of_the_edge_asks_and_acks_at_the_next_tick() -> None:
    """What was in flight through the lost connection may be gone: asked for
    again and acked at once, not at the silence rule."""
    publisher = RecordingPublisher()
    r, _ = await streaming(publisher)
    nc = Reconnecting()
    r.ctx = dataclasses.replace(r.ctx, link=Link(nc, 1.0))  # type: ignore[arg-type]
    await r._handle([Chunk(2, event(0))], time.monotonic())
    await r._on_tick(time.monotonic())
    assert sent(publisher) == []
    nc.stats["reconnects"] = 1
    await r._on_tick(time.monotonic())
    assert sent(publisher) == [(W1, Retransmit("r1", 3)), (W1, Ack("r1", 2))]


# -- admission ---------------------------------------------------------------


@pytest.mark.parametrize(("stream", "admission", "position", "note"), [
    (True, Admission.QUEUED, 3, b": queued position=3\n\n"),
    (True, Admission.QUEUED, 0, None),
    (True, Admission.ADMITTED, 0, None),
    (False, Admission.QUEUED, 3, None)])
async def test_a_queue_note_goes_only_to_a_stream_with_a_place_in_the_queue(
        stream: bool, admission: Admission, position: int, note: bytes | None) -> None:
    """A note written is the response begun (200): a body or an admitted
    stream gets none."""
    r = relay(RecordingPublisher(), stream=stream)
    out = recorded(r)
    await r._handle([Status(admission, position=position)], time.monotonic())
    assert out.writes == ([(note, False)] if note else [])


class Starting(Recorded):
    """The recorder, which also counts the starts of its response."""

    __slots__ = ("starts",)

    def __init__(self, r: Relay) -> None:
        super().__init__(r.request, r.ctx.config)
        self.starts = 0

    @property
    def started(self) -> bool:
        return self.starts > 0

    async def start(self) -> None:
        self.starts += 1


@pytest.mark.parametrize(("resumable", "starts"), [(True, 1), (False, 0)])
async def test_only_a_resumable_stream_begins_at_its_admission(resumable: bool,
                                                               starts: int) -> None:
    """A resumable stream's 200 and request id go out once it is admitted,
    so a client whose edge dies before the first token can resume it; any
    other keeps its status open for an error until its first bytes."""
    r = relay(RecordingPublisher(), resumable=resumable)
    out = Starting(r)
    r.out = out
    await r._handle([Status(Admission.ADMITTED)], time.monotonic())
    assert out.starts == starts


async def test_an_admitted_request_waits_for_a_worker_until_the_queue_timeout() -> None:
    """Admitted, the dispatcher's part is done: the admission timeout no
    longer applies, the queue timeout does, and its error names the model."""
    r = relay(RecordingPublisher())
    recorded(r)
    edge = r.ctx.config.edge
    await r._handle([Status(Admission.ADMITTED)], time.monotonic())
    await r._on_tick(r.started + edge.admission_timeout + 1)
    with pytest.raises(ApiError) as err:
        await r._on_tick(r.started + edge.queue_timeout)
    assert err.value.code == "no_worker_available"
    assert "model 'fake'" in err.value.message


@pytest.mark.parametrize("error", [
    ErrorInfo(429, "rate_limit_error", "rate_limited", "Too many requests.", True, 2.0), None])
async def test_a_rejection_ends_with_its_own_error_and_cancels_nothing(
        error: ErrorInfo | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """The dispatcher refused it: nothing runs upstream, so no tombstone, no
    cancel counted."""
    cancelled: list[str] = []
    monkeypatch.setattr(instrument, "cancelled", cancelled.append)
    publisher = RecordingPublisher()
    r = relay(publisher)
    out = recorded(r)
    r.session.feed(Status(Admission.REJECTED, error=error))
    await asyncio.wait_for(r.run(), 5)
    [failed] = out.failed
    got = (failed.status, failed.type, failed.code, failed.message, failed.retryable)
    if error is None:
        assert got == (503, "service_unavailable", "service_unavailable", "Rejected.", True)
    else:
        assert got == (429, "rate_limit_error", "rate_limited", "Too many requests.", True)
        assert failed.retry_after == 2.0
    assert (publisher.published, publisher.tombstones, cancelled) == ([], [], [])


# -- what the client got -----------------------------------------------------


async def test_the_first_byte_is_measured_at_the_first_write(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The time-to-first-byte metric, taken once."""
    firsts: list[int] = []
    r, _ = await streaming(RecordingPublisher())
    monkeypatch.setattr(instrument, "first_byte", lambda: firsts.append(r.expected_seq))
    await r._handle([Chunk(2, event(0))], time.monotonic())
    await r._handle([Chunk(3, event(1))], time.monotonic())
    assert firsts == [3]


async def test_a_done_carries_its_cost_in_the_configured_currency() -> None:
    """docs/spend.md: ``x-tidegate-cost`` with ``x-tidegate-currency``."""
    r, _ = await streaming(RecordingPublisher())
    assert await r._handle([Done(2, 5, 2, "stop", "0.0012")], time.monotonic())
    assert r.headers["x-tidegate-cost"] == "0.0012"
    assert r.headers["x-tidegate-currency"] == r.ctx.config.spend.currency == "USD"


async def test_the_next_worker_continues_the_text_written_by_either_path() -> None:
    """The relay's batches (past the fold, where the kept chunks become text)
    and the direct path's chunks are both what the client got: the next
    worker continues all of it."""
    publisher = RecordingPublisher()
    r, _ = await streaming(publisher)
    pieces = ["a" * 1000] * (FOLD_AT // 1000 + 2)
    batch: list[SessionMessage] = [Chunk(seq, chunk(text))
                                   for seq, text in enumerate(pieces, start=2)]
    await r._handle(batch, time.monotonic())
    assert r.delivered is not None
    assert r.delivered.folded  # past FOLD_AT: folded
    r.raw = lambda data, now: True
    assert r._direct(Chunk(len(pieces) + 2, chunk("b")))
    await dies(r)
    publisher.published.clear()
    await r._on_head(Head(first_seq(2), W2, 7, 2, JOB_ACK))
    text = "".join(pieces) + "b"
    assert sent(publisher) == [(W2, Continue("r1", text, len(pieces) + 1,
                                             response_id="chatcmpl-1"))]


class Kept(Log):
    """The edge's StreamLog: what it was asked to store, message by message."""

    def __init__(self) -> None:
        super().__init__()
        self.stored: list[list[Chunk | Heartbeat]] = []

    async def refill(self, request_id: str, tail: object) -> None:
        assert isinstance(tail, LiveTail)
        self.stored.append(tail.after(1) or [])
        await super().refill(request_id, tail)


async def test_a_resumable_streams_log_gets_what_its_client_got_when_its_worker_dies(
) -> None:
    """Chunks and heartbeats alike (a reader's seqs run through both), the
    relay's and the direct path's (a WebSocket generation's)."""
    r, _ = await streaming(RecordingPublisher(), resumable=True)
    log = Kept()
    r.ctx = dataclasses.replace(r.ctx, streamlog=log)  # type: ignore[arg-type]
    messages: list[Chunk | Heartbeat] = [Chunk(2, chunk("Hel")), Heartbeat(3),
                                         Chunk(4, chunk("lo")), Chunk(5, chunk("!"))]
    await r._handle([*messages[:3]], time.monotonic())
    r.raw = lambda data, now: True
    assert r._direct(Chunk(5, chunk("!")))
    await dies(r)
    assert log.stored == [messages]


async def test_a_stream_without_a_log_keeps_no_tail_for_one() -> None:
    """Only a resumable stream holds its last messages (64 of them) for its
    log."""
    r, _ = await streaming(RecordingPublisher())
    log = Kept()
    r.ctx = dataclasses.replace(r.ctx, streamlog=log)  # type: ignore[arg-type]
    await r._handle([Chunk(2, chunk("Hel"))], time.monotonic())
    await dies(r)
    assert log.refills == []
    assert r.handed_back


async def test_a_resumable_responses_stream_numbers_its_events_without_a_retry_field(
) -> None:
    """A Responses event carries its own sequence_number: its stream gets the
    ``id:`` lines, and no ``retry:`` field."""
    config = Config()
    request = dataclasses.replace(make_request("r1"), api=Api.RESPONSES, resumable=True)
    out = Recorded(request, config)
    r = Relay(out, Session("r1", 0.1), request, RelayContext(config, RecordingPublisher()), {})
    await r._on_head(Head(1, W1, 7, 1, JOB_ACK))
    created = b'event: response.created\ndata: {"sequence_number": 0}\n\n'
    await r._handle([Chunk(2, created)], time.monotonic())
    assert out.writes == [(b"id: 1\n" + created, False)]


# -- counted and ended -------------------------------------------------------


async def test_an_earlier_deliverys_late_output_is_counted_as_session_input(
        drops: Drops) -> None:
    """Counted where an operator sees dropped input (its metric's labels)."""
    r = relay(RecordingPublisher())
    recorded(r)
    await r._on_head(Head(first_seq(2), W2, 7, 2, JOB_ACK))
    await r._handle([Chunk(2, event(0)), Chunk(3, event(1))], time.monotonic())
    assert drops.dropped == [("session", "earlier_delivery")]
    assert r.stale == 2


async def test_a_malformed_message_is_counted_and_ends_with_a_retryable_server_error(
        drops: Drops) -> None:
    """Counted where an operator sees dropped input; the client gets the
    documented error, which says to retry."""
    r = relay(RecordingPublisher())
    out = recorded(r)
    task = await running(r)
    r.session.feed(Chunk(2, 12345))  # type: ignore[arg-type]  # well framed, wrong type
    await asyncio.wait_for(task, 5)
    assert drops.dropped == [("session", "wrong_types")]
    [failed] = out.failed
    assert (failed.status, failed.type, failed.code, failed.retryable) == (
        502, "server_error", "protocol_error", True)
    assert failed.message == "The gateway received a malformed message for this response."


class Stuck(RecordingWriter):
    """A client that never drains its socket."""

    __slots__ = ()

    async def write(self, data: bytes, *, last: bool = False) -> None:
        raise SlowClient()


async def test_a_client_too_slow_to_drain_is_cut_off_and_its_worker_cancelled(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker, the tombstone and the cancel metric all say why."""
    cancelled: list[str] = []
    monkeypatch.setattr(instrument, "cancelled", cancelled.append)
    publisher = RecordingPublisher()
    r = relay(publisher)
    r.out = Stuck()
    task = await running(r)
    publisher.published.clear()
    r.session.feed(Chunk(2, event(0)))
    await asyncio.wait_for(task, 5)
    assert sent(publisher) == [(W1, Cancel("r1", "slow_client"))]
    assert publisher.tombstones == [("r1", "slow_client")]
    assert cancelled == ["slow_client"]


async def test_a_message_after_a_long_silence_keeps_the_stream() -> None:
    """Every message the relay takes restarts the worker-silence limit, not
    only those the direct path writes."""
    r = relay(RecordingPublisher())
    out = RecordingWriter()
    r.out = out
    task = await running(r)
    lost_after = r.ctx.config.session.heartbeat_interval * r.ctx.config.session.worker_lost_after
    # All before the relay runs again: it takes the heartbeat, then the tick.
    r.last_worker_msg -= 2 * lost_after
    r.session.ticked = True
    r.session.feed(Heartbeat(2))
    await wait_for(lambda: bool(out.calls))
    r.session.feed(Done(3, 1, 0, "stop"))
    await asyncio.wait_for(task, 5)
    assert out.calls == [("write", PING[0]), ("finish", b"")]


async def test_a_handed_back_stream_waits_through_its_ticks_for_the_next_worker(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker found dead before output: the job is handed back, and the
    silence limit counts from then, tick after tick, until the next
    worker's Head takes the stream on."""
    ticks: list[float] = []
    tick = Relay._on_tick

    async def counted(self: Relay, now: float) -> None:
        ticks.append(now)
        await tick(self, now)

    monkeypatch.setattr(Relay, "_on_tick", counted)
    publisher = RecordingPublisher()
    r = relay(publisher)
    out = RecordingWriter()
    r.out = out
    task = await running(r)
    r.session.worker_lost(W1)
    await wait_for(lambda: r.handed_back)
    seen = len(ticks)
    await wait_for(lambda: len(ticks) > seen)  # a tick past the hand-back
    if task.done():  # it must wait on: show why it ended
        await task
        pytest.fail("the relay ended with its job handed back")
    publisher.published.clear()
    head = first_seq(2)
    for message in (Head(head, W2, 7, 2, JOB_ACK), Chunk(head + 1, event(0)),
                    Done(head + 2, 1, 1, "stop")):
        r.session.feed(message)
    await asyncio.wait_for(task, 5)
    assert (r.phase, r.control) == (Phase.STREAMING, W2)
    assert sent(publisher)[0] == (W2, Ack("r1", 0))  # the go-ahead
    assert out.calls == [("write", event(0)), ("finish", b"")]
