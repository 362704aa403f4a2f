"""How the edge lets go of a request's upstream (edge.relay), unit, no socket:
a client that leaves, an error, a second copy, a body past its bound.

| the end | what goes upstream |
| --- | --- |
| client gone, plain stream | ``Cancel`` to its worker (if one started it) and a tombstone, once |
| client gone, resumable stream | ``Detach`` to its worker: it generates on into the log |
| an error before any worker | a resumable stream's log gets the error, for its readers |
| a second delivery | ``Cancel(duplicate_delivery)`` to the copy's worker |
| the broker down meanwhile | nothing raised: the real outcome is the client's |
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request

from edge import instrument
from edge.relay import Relay
from edge.sse_writer import SseWriter
from edge.stream import Phase
from tests.test_relay_direct import RecordingPublisher, wait_for
from tests.test_relay_heads import JOB_ACK, W1, W2, relay, sent
from tidegate.config import Config
from tidegate.errors import ApiError
from tidegate.wire import streamlog
from tidegate.wire.protocol import (
    DUPLICATE_DELIVERY,
    Cancel,
    Chunk,
    Detach,
    Error,
    Head,
    Request,
    decode_session,
)


class DownPublisher(RecordingPublisher):
    """A broker that refuses everything (a partition, a restart)."""

    async def publish(self, subject: str, payload: bytes) -> None:
        raise ConnectionError("nats: connection closed")

    async def tombstone(self, request_id: str, reason: str) -> None:
        raise ConnectionError("nats: connection closed")


async def test_a_plain_streams_client_gone_cancels_its_worker_and_tombstones_it_once() -> None:
    publisher = RecordingPublisher()
    r = relay(publisher)
    await r._on_head(Head(1, W1, 7, 1))
    await r._leave("client_disconnected")
    await r._leave("client_disconnected")
    assert sent(publisher) == [(W1, Cancel("r1", "client_disconnected"))]
    assert publisher.tombstones == [("r1", "client_disconnected")]
    assert r.upstream_done


async def test_before_any_worker_only_the_tombstone_stops_it() -> None:
    publisher = RecordingPublisher()
    r = relay(publisher)
    await r._cancel_upstream("slow_client")
    assert sent(publisher) == []
    assert publisher.tombstones == [("r1", "slow_client")]


async def test_a_resumable_streams_client_gone_detaches_and_cancels_nothing() -> None:
    publisher = RecordingPublisher()
    r = relay(publisher, resumable=True)
    await r._on_head(Head(1, W1, 7, 1))
    await r._leave("client_disconnected")
    await r._leave("client_disconnected")
    assert sent(publisher) == [(W1, Detach("r1", ""))]
    assert publisher.tombstones == []
    assert r.upstream_done


async def test_a_resumable_stream_left_before_its_head_tells_no_one() -> None:
    """Its worker, once it starts, sees no ack and detaches at its ack timeout."""
    publisher = RecordingPublisher()
    r = relay(publisher, resumable=True)
    await r._leave("client_disconnected")
    assert sent(publisher) == []
    assert publisher.tombstones == []
    assert r.upstream_done


async def test_a_broker_that_is_down_does_not_mask_the_outcome() -> None:
    r = relay(DownPublisher())
    await r._on_head(Head(1, W1, 7, 1))
    await r._cancel_upstream("client_disconnected")  # nothing raised
    assert r.upstream_done
    await r._cancel_second_delivery(Head(2, W2, 7, 2))
    resumable = relay(DownPublisher(), resumable=True)
    await resumable._on_head(Head(1, W1, 7, 1))
    await resumable._leave("client_disconnected")
    assert resumable.upstream_done


async def test_a_second_delivery_is_told_to_drop_its_copy() -> None:
    publisher = RecordingPublisher()
    r = relay(publisher)
    await r._on_head(Head(1, W1, 7, 1))
    publisher.published.clear()
    await r._cancel_second_delivery(Head(2, W2, 7, 2))
    assert sent(publisher) == [(W2, Cancel("r1", DUPLICATE_DELIVERY))]
    assert r.control == W1


@pytest.mark.parametrize("resumable", [True, False])
async def test_an_error_before_any_worker_reaches_a_resumable_streams_log(
        resumable: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    failed: list[str] = []
    monkeypatch.setattr(instrument, "failed", lambda e: failed.append(e.code or ""))
    publisher = RecordingPublisher()
    r = relay(publisher, resumable=resumable)
    error = ApiError(429, "Too many requests.", type="rate_limit_error", code="rate_limited")
    response = await r._fail(error)
    assert response.status == 429
    assert failed == ["rate_limited"]
    subject = streamlog.subject(r.ctx.config.nats.subjects, "r1")
    logged = [(s, decode_session(p)) for s, p in publisher.published]
    if resumable:
        assert len(logged) == 1
        assert logged[0][0] == subject
        end = logged[0][1]
        assert isinstance(end, Error)
        assert (end.seq, end.error.status, end.error.code) == (0, 429, "rate_limited")
    else:
        assert logged == []


async def test_a_clients_own_cancel_is_no_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    failed: list[ApiError] = []
    monkeypatch.setattr(instrument, "failed", failed.append)
    r = relay(RecordingPublisher())
    await r._fail(ApiError(499, "The client cancelled the request.", type="client_error",
                           code="client_cancelled"))
    assert failed == []


async def test_an_error_once_streaming_leaves_the_log_to_its_worker() -> None:
    publisher = RecordingPublisher()
    r = relay(publisher, resumable=True)
    await r._on_head(Head(1, W1, 7, 1))
    publisher.published.clear()
    assert r.phase is Phase.STREAMING
    await r._fail(ApiError(502, "Upstream broke.", type="server_error", code="backend_error"))
    assert publisher.published == []


async def test_a_collected_body_is_bounded_by_max_response_bytes() -> None:
    r = relay(RecordingPublisher(), stream=False)
    limit = r.ctx.config.edge.max_response_bytes
    r._collect(b"x" * (limit - 1))
    r._collect(b"y")
    assert r.body_size == limit
    assert [len(p) for p in r.body_parts] == [limit - 1, 1]
    with pytest.raises(ApiError) as err:
        r._collect(b"z")
    assert (err.value.status, err.value.code) == (502, "response_too_large")
    assert len(r.body_parts) == 2


class Recorded(SseWriter):
    """The SSE writer, its writes and reconnects recorded instead of sent."""

    __slots__ = ("failed", "reconnects", "writes")

    def __init__(self, request: Request, config: Config) -> None:
        super().__init__(make_mocked_request("POST", "/v1/chat/completions"), request, {},
                         config)
        self.writes: list[tuple[bytes, bool]] = []
        self.reconnects: list[tuple[str, int]] = []
        self.failed: list[ApiError] = []

    async def fail(self, error: ApiError) -> web.StreamResponse:
        self.failed.append(error)
        return web.Response(status=error.status)

    async def write(self, data: bytes, *, last: bool = False) -> None:
        self.writes.append((data, last))

    async def reconnect(self, request_id: str, last_event_id: int) -> None:
        self.reconnects.append((request_id, last_event_id))


def recorded(r: Relay) -> Recorded:
    out = Recorded(r.request, r.ctx.config)
    r.out = out
    return out


class Log:
    """The edge's StreamLog: what it was asked to store."""

    def __init__(self) -> None:
        self.refills: list[tuple[str, int]] = []

    async def refill(self, request_id: str, tail: Any) -> None:
        self.refills.append((request_id, len(tail)))


def with_log(r: Relay) -> Log:
    log = Log()
    r.ctx = dataclasses.replace(r.ctx, streamlog=log)  # type: ignore[arg-type]
    return log


@pytest.mark.parametrize(("code", "streaming", "refilled"), [
    ("worker_lost", True, True), ("worker_lost", False, False), ("backend_error", True, False)])
async def test_the_silence_limits_worker_lost_stores_what_the_client_got(
        code: str, streaming: bool, refilled: bool) -> None:
    """A resumable stream whose worker went silent: the log gets the tail the
    log may lack before the end is told (the worker_gone path does the same)."""
    publisher = RecordingPublisher()
    r = relay(publisher, resumable=True)
    log = with_log(r)
    if streaming:
        await r._on_head(Head(1, W1, 7, 1))
        assert r.tail is not None
        r.tail.add(Chunk(2, b'data: {"a": 1}\n\n'))
    await r._fail(ApiError(502, "gone", type="server_error", code=code))
    assert bool(log.refills) is refilled
    if refilled:
        assert log.refills == [("r1", 1)]
        assert r.tail is None  # at most once
        await r.refill_log()
        assert len(log.refills) == 1


async def test_a_body_past_its_bound_is_a_server_error() -> None:
    r = relay(RecordingPublisher(), stream=False)
    with pytest.raises(ApiError) as err:
        r._collect(b"x" * (r.ctx.config.edge.max_response_bytes + 1))
    assert (err.value.type, err.value.status) == ("server_error", 502)
    assert "stream=true" in err.value.message


async def test_a_cancel_is_counted_by_its_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    reasons: list[str] = []
    monkeypatch.setattr(instrument, "cancelled", reasons.append)
    r = relay(RecordingPublisher())
    await r._cancel_upstream("client_disconnected")
    await r._cancel_upstream("client_disconnected")
    assert reasons == ["client_disconnected"]


@pytest.mark.parametrize("numbered", [True, False])
async def test_a_draining_edge_sends_its_client_to_resume_and_detaches(numbered: bool) -> None:
    publisher = RecordingPublisher()
    r = relay(publisher, resumable=True)
    out = recorded(r)
    await r._on_head(Head(1, W1, 7, 1))
    publisher.published.clear()
    if not numbered:
        r.ids = None
    elif r.ids is not None:
        r.ids.last = 4
    await r._reconnect()
    assert out.reconnects == [("r1", 4 if numbered and r.ids is not None else 0)]
    assert sent(publisher) == [(W1, Detach("r1", ""))]
    assert r.last_write > 0


async def test_a_tick_with_nothing_due_sends_nothing_and_the_end_is_written_last() -> None:
    publisher = RecordingPublisher()
    r = relay(publisher)
    out = recorded(r)
    await r._on_head(Head(1, W1, 7, 1))
    publisher.published.clear()
    await r._on_tick(time.monotonic())
    assert sent(publisher) == []
    assert out.writes == []
    await r._write(b"data: [DONE]\n\n", last=True)
    await r._write(b"x")
    assert out.writes == [(b"data: [DONE]\n\n", True), (b"x", False)]


async def running(r: Relay) -> asyncio.Task[Any]:
    """``r.run()`` as the handler's task, past its worker's Head."""
    task = asyncio.create_task(r.run())
    r.session.feed(Head(1, W1, 7, 1, JOB_ACK))
    await wait_for(lambda: r.phase is Phase.STREAMING, 5)
    return task


async def test_a_client_that_goes_away_cancels_the_backend_call() -> None:
    """The handler is cancelled (aiohttp does so when the client hangs up):
    the worker is told to stop at once, and the request is tombstoned."""
    publisher = RecordingPublisher()
    r = relay(publisher)
    recorded(r)
    task = await running(r)
    publisher.published.clear()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert sent(publisher) == [(W1, Cancel("r1", "client_disconnected"))]
    assert publisher.tombstones == [("r1", "client_disconnected")]


async def test_a_malformed_message_ends_the_stream_with_a_retryable_502() -> None:
    publisher = RecordingPublisher()
    r = relay(publisher)
    out = recorded(r)
    task = await running(r)
    publisher.published.clear()
    r.session.feed(Chunk(2, 12345))  # type: ignore[arg-type]  # well framed, wrong type
    await asyncio.wait_for(task, 5)
    assert [(e.status, e.code, e.retryable) for e in out.failed] == [
        (502, "protocol_error", True)]
    assert sent(publisher) == [(W1, Cancel("r1", "edge:protocol_error"))]


async def test_a_worker_found_dead_mid_stream_is_handed_back_from_the_loop() -> None:
    publisher = RecordingPublisher()
    r = relay(publisher)
    recorded(r)
    task = await running(r)
    publisher.published.clear()
    r.session.worker_lost(W1)  # as the edge's probe tells it; the loop acts on it
    await wait_for(lambda: len(publisher.published) >= 2, 5)
    assert sent(publisher)[:2] == [(W1, Cancel("r1", DUPLICATE_DELIVERY)), (JOB_ACK, b"-NAK")]
    assert r.handed_back
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
