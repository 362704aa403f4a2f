"""One request's response, from session messages to the client socket.

Phases (an enum, not a scatter of flags)::

    WAITING --Status(admitted|queued)--> ADMITTED --Head--> STREAMING --Done--> (end)
       |                                     |                  |
       +------ Status(rejected) / Error / timeout / worker lost / client gone --> (end)

Headers go out only when they must: with the first chunk, or, for a stream
that waits long before it (queueing, prefill), with the first ``: ping`` the
edge writes to keep proxies from dropping the connection (one heartbeat in).
Until then every failure is a real HTTP status with an OpenAI error body;
afterwards a final SSE error event (``edge.errors``). An edge cut from NATS
releases its streams (``tidegate.broker.link``).

Hot path: a batch of chunk messages becomes one socket write of their bytes,
which the edge never parses. Acks go back cumulatively, after the write has
drained, at most once per half window (``tidegate.wire.flow.AckPolicy``). Once a
stream is flowing, most chunks do not even wake the relay: the NATS callback
writes them straight to the socket (:meth:`Relay._direct`), and the relay
wakes only for acks, ticks, a full socket buffer and the other messages.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Protocol

from aiohttp import web
from aiohttp.http_writer import StreamWriter

from edge import instrument
from edge.continuation import Delivered, continuable, worker_gone
from edge.endings import Reconnect, SlowClient, reconnect_event, worker_lost
from edge.errors import error_response, from_info, sse_error_event, to_info
from edge.liveness import WorkerWatch
from edge.session import BAD_INPUT, Session
from tidegate.broker.link import Link
from tidegate.config import Config, ModelConfig
from tidegate.errors import ApiError, unavailable
from tidegate.wire import streamlog
from tidegate.wire.flow import AckPolicy
from tidegate.wire.protocol import (
    Ack,
    Admission,
    Api,
    Cancel,
    Chunk,
    Continue,
    Detach,
    Done,
    Error,
    ErrorInfo,
    Head,
    Heartbeat,
    Request,
    Retransmit,
    SessionMessage,
    Status,
)

log = logging.getLogger("tidegate.edge")

CLIENT_CANCEL = "client_cancel"  # workers.job.CLIENT_CANCEL: readers get a final event

_DONE = b"data: [DONE]\n\n"
_PING = b": ping\n\n"
_SSE_HEADERS = {
    "Content-Type": "text/event-stream; charset=utf-8",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",
}


class Phase(IntEnum):
    WAITING = 0  # published; no dispatcher has answered
    ADMITTED = 1  # admitted or queued; no worker has started it
    STREAMING = 2  # a worker's Head arrived


class Publisher(Protocol):
    """What the relay needs from NATS (a seam: tests can record calls)."""

    async def publish(self, subject: str, payload: bytes) -> None: ...

    async def tombstone(self, request_id: str, reason: str) -> None:
        """Record the cancel durably, for whoever picks the request up later."""


@dataclass(frozen=True, slots=True)
class RelayContext:
    """What every relay of one edge process shares."""

    config: Config
    publisher: Publisher
    link: Link = field(default_factory=lambda: Link(None, 0.0))  # partitions: broker/link.py
    watch: WorkerWatch | None = None  # the edge's worker liveness probe (edge.liveness)
    models: Mapping[str, ModelConfig] = field(default_factory=dict)  # failover per model


class Relay:
    """Drives one request. ``run`` returns the response aiohttp should finish."""
    # One per open stream, 10,000 of them on an edge: no per-instance dict.
    __slots__ = ("acks", "asked_at", "body_parts", "body_size", "control", "ctx", "delivered",
                 "expected_seq", "failover", "gap_since", "head_key", "headers", "high_water",
                 "http", "ids", "job_ack", "last_ack", "last_worker_msg", "last_write", "phase",
                 "request", "response", "session", "started", "upstream_done", "wrote_chunks")

    def __init__(self, http: web.Request, session: Session, request: Request,
                 ctx: RelayContext, headers: dict[str, str]) -> None:
        self.http = http
        self.session = session
        self.request = request
        self.ctx = ctx
        self.headers = headers
        self.phase = Phase.WAITING
        self.response: web.StreamResponse | None = None
        self.control = ""  # worker control subject, once known
        self.job_ack = ""  # the job message's JetStream ack subject (Head.ack)
        model = ctx.models.get(request.model)
        self.failover = model.failover if model is not None else "restart"
        # failover = "continue": what the client got, for the next worker.
        self.delivered = Delivered() if continuable(request, model) else None
        self.acks = AckPolicy(request.window_bytes, request.window_msgs)
        self.expected_seq = 1
        # A lost worker message (see _check_seq): when the gap opened (0 = no
        # gap) and when this edge last asked for a retransmit.
        self.gap_since = 0.0
        self.asked_at = 0.0
        self.head_key: tuple[str, int, int] | None = None
        self.wrote_chunks = False
        self.body_parts: list[bytes] = []
        self.body_size = 0
        self.upstream_done = False  # the worker/dispatcher ended it: nothing to cancel
        self.started = self.last_worker_msg = self.last_write = time.monotonic()
        self.high_water = max(4096, request.window_bytes // 4)
        self.last_ack = time.monotonic()
        # A resumable stream numbers its SSE events (tidegate.wire.streamlog);
        # None for every other request, whose bytes go out as they came.
        # The first event's block also says how long an EventSource waits to
        # reconnect (not on a Responses stream: its events carry
        # sequence_number, and the SDK needs none).
        self.ids = (streamlog.EventIds(
            b"" if request.api is Api.RESPONSES
            else streamlog.retry_field(ctx.config.resume.retry_ms))
            if request.resumable and request.stream else None)
        session.resumable = self.ids is not None

    async def run(self) -> web.StreamResponse:
        finished = False
        try:
            response = await self._relay()
            finished = True
            return response
        except Reconnect:
            finished = True
            await self._reconnect()
            assert self.response is not None
            return self.response
        except ApiError as error:
            finished = True
            await self._cancel_upstream(CLIENT_CANCEL if error.code == "stream_cancelled"
                                        else f"edge:{error.code or error.type}")
            return await self._fail(error)
        except SlowClient:
            finished = True
            log.info("request %s: client did not drain for %.0fs; disconnected", self.request.id,
                     self.ctx.config.edge.slow_client_timeout)
            await self._leave("slow_client")
            assert self.response is not None
            return self.response
        finally:
            if not finished:
                # Client went away (handler cancelled) or an unexpected error:
                # whatever runs upstream for this request is now waste, unless
                # the stream is resumable and the client may come back.
                await self._leave("client_disconnected")

    async def _reconnect(self) -> None:
        """End a resumable stream with the reconnect event, and detach: the
        worker generates on, and the client resumes on another edge."""
        cfg = self.ctx.config.resume
        last = self.ids.last if self.ids is not None else 0
        try:
            await self._write(reconnect_event(self.request.id, last, cfg.retry_ms), last=True)
        except (ConnectionError, RuntimeError, SlowClient):
            pass
        await self._leave("edge_draining")

    async def _leave(self, reason: str) -> None:
        """The client is gone: cancel, or, for a resumable stream, detach (the
        worker generates on into the log for the stream's grace)."""
        if not self.request.resumable:
            await self._cancel_upstream(reason)
            return
        if self.upstream_done:
            return
        self.upstream_done = True
        log.info("request %s: client left a resumable stream (%s)", self.request.id, reason)
        if self.control:
            # Before any Head there is no worker to tell: the one that starts
            # it sees no ack and detaches at its ack timeout.
            try:
                await self.ctx.publisher.publish(self.control,
                                                 Detach(self.request.id, "").encode())
            except Exception as exc:
                log.warning("could not publish detach for %s: %s", self.request.id, exc)

    async def _fail(self, error: ApiError) -> web.StreamResponse:
        instrument.failed(error)
        if self.request.resumable and self.phase is not Phase.STREAMING:
            # No worker wrote to the log yet: the log's readers learn the end here.
            try:
                await self.ctx.publisher.publish(
                    streamlog.subject(self.ctx.config.nats.subjects, self.request.id),
                    Error(0, to_info(error)).encode())
            except Exception as exc:
                log.warning("could not log the end of %s: %s", self.request.id, exc)
        if self.response is None:
            response = error_response(error, self.request.api)
            # Request id and rate-limit headers on errors too (a 429 needs x-ratelimit-*).
            response.headers.update(self.headers)
            return response
        try:
            await self.response.write(sse_error_event(error, self.request.api))
            await self.response.write_eof()
        except (ConnectionError, RuntimeError):
            pass
        return self.response

    async def _cancel_upstream(self, reason: str) -> None:
        """Stop whatever still works on this request: the worker directly, when
        known (the fast path: it closes the backend response at once), and a
        tombstone for a dispatcher or worker that has yet to pick it up."""
        if self.upstream_done:
            return
        self.upstream_done = True
        instrument.cancelled(reason)
        try:
            if self.control:
                await self.ctx.publisher.publish(self.control,
                                                 Cancel(self.request.id, reason).encode())
            await self.ctx.publisher.tombstone(self.request.id, reason)
        except Exception as exc:  # the broker being down must not mask the real outcome
            log.warning("could not publish cancel for %s: %s", self.request.id, exc)

    async def _relay(self) -> web.StreamResponse:
        try:
            return await self._loop()
        finally:
            # However the relay ends, only this task writes from now on (the
            # end of the body, an error event): a chunk arriving meanwhile
            # must not follow it out.
            self.session.direct = None

    async def _loop(self) -> web.StreamResponse:
        session = self.session

        while True:
            await session.wait()
            if session.aborted is not None:
                raise session.aborted
            now = time.monotonic()
            messages = session.take()
            if messages:
                # While this relay holds taken messages, a chunk arriving
                # behind them must queue too, not overtake them to the socket.
                session.direct = None
                try:
                    done = await self._handle(messages, now)
                except (TypeError, ValueError, AttributeError) as exc:
                    # A well-framed message with fields of the wrong type
                    # (decode_session checks framing, not types, to keep the
                    # chunk path cheap): this stream cannot go on, the edge can.
                    BAD_INPUT.drop("session", "wrong_types", repr(exc))
                    raise ApiError(502, "The gateway received a malformed message for this "
                                        "response.", type="server_error",
                                   code="protocol_error", retryable=True) from None
                if self.phase is Phase.STREAMING:
                    self.last_worker_msg = now
                if done:
                    return await self._finish()
                if self.wrote_chunks:
                    session.direct = self._direct_writer()
            if session.lost:
                await worker_gone(self, session.lost, now)
            if session.take_tick():
                await self._on_tick(now)

    async def _on_tick(self, now: float) -> None:
        """The clock checks, run about once a second per request (not per chunk)."""
        cfg = self.ctx.config
        if now >= self.started + cfg.edge.request_timeout:
            raise ApiError(504, f"The request exceeded the gateway's limit of "
                                f"{cfg.edge.request_timeout:g}s.",
                           type="server_error", code="request_timeout")
        if self.ctx.link.lost(now):  # cut from NATS: nothing more can come
            if self.ids is not None:
                # In every phase: the log was opened and the request stored
                # before this loop began (edge/publish.py), so another edge's
                # resume reads whatever the worker writes, from event 1 if it
                # had not started, or the clean end if none picks it up.
                raise Reconnect("lost its message broker")
            raise unavailable("This gateway node lost its connection to the message broker.",
                              code="broker_unavailable", retry_after=1)
        if self.phase is Phase.WAITING and now >= self.started + cfg.edge.admission_timeout:
            raise unavailable(f"No dispatcher answered within {cfg.edge.admission_timeout:g}s.",
                              code="dispatcher_unavailable", retry_after=5)
        if self.phase is Phase.ADMITTED and now >= self.started + cfg.edge.queue_timeout:
            raise unavailable(f"No worker for model '{self.request.model}' started the "
                              f"request within {cfg.edge.queue_timeout:g}s.",
                              code="no_worker_available", retry_after=5)
        heartbeat = cfg.session.heartbeat_interval
        lost_after = heartbeat * cfg.session.worker_lost_after
        if self.phase is not Phase.STREAMING and self.gap_since:
            await self._ask_retransmit(now)  # the Head is missing (see _check_seq)
        if self.phase is Phase.STREAMING:
            if self.gap_since and self.ids is not None and now - self.gap_since >= heartbeat:
                # A resumable stream has its log: rather than wait for a resend
                # that may not come (a worker that no longer keeps messages for
                # this connection), send the client to resume from the log.
                raise Reconnect()
            if self.gap_since and now - self.gap_since >= lost_after:
                raise ApiError(502, f"Lost part of the response (message {self.expected_seq}) "
                                    f"and the worker did not send it again within "
                                    f"{lost_after:g}s.", type="server_error",
                               code="stream_gap", retryable=True, retry_after=1)
            silent = now - self.last_worker_msg
            if silent >= lost_after:
                raise ApiError(502, f"The worker running this request went silent for "
                                    f"{lost_after:g}s.", type="server_error",
                               code="worker_lost", retryable=True, retry_after=1)
            if self.gap_since or (silent >= 1.5 * heartbeat and now - self.asked_at >= heartbeat):
                # A gap still open, or a worker silent past its heartbeat: the
                # last message(s) may be what was lost (a Done, say), with
                # nothing behind them to show the gap. Asking costs nothing
                # when nothing was lost.
                await self._ask_retransmit(now)
        if self.request.stream and now - self.last_write >= cfg.session.heartbeat_interval:
            await self._write(_PING)
        if self.control and now - self.last_ack >= cfg.session.ack_timeout / 4:
            # Ack on time as well as on volume, even with nothing new: slow
            # output never reaches half a window, and a worker in a long
            # prefill must still learn that this edge is alive.
            await self._ack(self.acks.ack_now())

    async def _handle(self, messages: list[SessionMessage], now: float) -> bool:
        """Apply a batch of session messages; True once the response is complete."""
        out: list[bytes] = []
        nbytes = 0
        last_chunk = 0
        done = False
        ping = False
        failed: ErrorInfo | None = None
        for m in messages:
            kind = type(m)
            if kind is Chunk:
                assert isinstance(m, Chunk)
                if not self._check_seq(m.seq):
                    continue
                out.append(m.data)
                nbytes += len(m.data)
                last_chunk = m.seq
            elif kind is Heartbeat:
                if self._check_seq(m.seq):
                    ping = True
            elif kind is Head:
                assert isinstance(m, Head)
                await self._on_head(m)
            elif kind is Done:
                assert isinstance(m, Done)
                if self._check_seq(m.seq):
                    done = True
                    self.headers.update(m.cost_headers(self.ctx.config.spend.currency))
                    break
            elif kind is Error:
                assert isinstance(m, Error)
                self.upstream_done = True
                # Batched chunks go out first (200); the error is the last event.
                failed = m.error
                break
            elif kind is Status:
                assert isinstance(m, Status)
                if m.headers:
                    self.headers.update(m.headers)
                if m.admission is Admission.REJECTED:
                    self.upstream_done = True
                    raise from_info(m.error) if m.error else unavailable("Rejected.")
                if self.phase is Phase.WAITING:
                    self.phase = Phase.ADMITTED
                if m.admission is Admission.QUEUED and m.position and self.request.stream:
                    await self._write(self._queue_note(m.position))

        if self.gap_since:
            await self._ask_retransmit(now)
        if out:
            data = out[0] if len(out) == 1 else b"".join(out)
            if self.request.stream:
                if self.delivered is not None:
                    self.delivered.add(data)
                ids = self.ids
                if ids is not None:
                    data = ids.frame(data)
                await self._write(data)
                if not self.wrote_chunks:
                    instrument.first_byte()
                self.wrote_chunks = True
            else:
                self._collect(data)
            ack = self.acks.on_written(last_chunk, nbytes, len(out))
            if ack is not None:
                await self._ack(ack)
        elif ping and self.request.stream:
            await self._write(_PING)
        if failed is not None:
            raise from_info(failed)
        return done

    # -- message handling --------------------------------------------------------

    def _check_seq(self, seq: int) -> bool:
        """Whether the message with ``seq`` is the next one (take it). A copy
        of one already taken (a retransmit overlapping what arrived) is
        dropped; one past a gap (a core NATS message lost in transit) is
        dropped too, and the gap is asked to be sent again from its first
        missing seq (:meth:`_ask_retransmit`): the worker keeps every message
        not acked yet, so the stream goes on byte-exact. Only a gap that
        stays open until the worker counts as lost ends it (``stream_gap``)."""
        if self.phase is not Phase.STREAMING:
            # Output before its Head: the Head was lost in transit. It names
            # the worker, so ask every worker (Subjects.retransmit_any) to
            # send again from seq 1; the request's own deadlines still apply.
            if not self.gap_since:
                self.gap_since = time.monotonic()
                log.info("request %s: worker output before its Head (lost in transit?)",
                         self.request.id)
            return False
        expected = self.expected_seq
        if seq == expected:
            self.expected_seq = seq + 1
            self.gap_since = 0.0
            return True
        if seq > expected and not self.gap_since:
            self.gap_since = time.monotonic()
            log.info("request %s: message %d lost in transit (got %d); asking for it again",
                     self.request.id, expected, seq)
        return False

    async def _ask_retransmit(self, now: float) -> None:
        """Ask the worker to send everything from the first missing seq again;
        at most every 0.25 s (a burst of messages past one gap asks once)."""
        if now - self.asked_at < 0.25:
            return
        self.asked_at = now
        subject = self.control or self.ctx.config.nats.subjects.retransmit_any
        try:
            await self.ctx.publisher.publish(
                subject, Retransmit(self.request.id, self.expected_seq).encode())
        except Exception as exc:  # the tick asks again
            log.warning("could not ask for a retransmit of %s: %s", self.request.id, exc)

    async def _ack(self, seq: int) -> None:
        self.last_ack = time.monotonic()
        if self.control:
            await self.ctx.publisher.publish(self.control, Ack(self.request.id, seq).encode())

    async def _on_head(self, head: Head) -> None:
        key = (head.control, head.job_seq, head.attempt)
        if self.phase is Phase.STREAMING and key == self.head_key:
            return  # the same Head again (the worker resent what was not acked)
        self.head_key = key
        self.control = head.control  # from now on, cancels go to this worker
        self.job_ack = head.ack if head.ack.startswith("$JS.ACK.") else ""
        if self.ctx.watch is not None:
            self.session.follow(self.ctx.watch, head.control)
        if head.attempt > 1 or self.phase is Phase.STREAMING:
            go = Ack(self.request.id, 0).encode()
            if self.body_size and self.failover != "off":
                self.body_parts, self.body_size = [], 0  # none of it reached the client
            if self.wrote_chunks or self.body_size:
                # Redelivered after output reached the client: only a
                # continuation of the delivered text may follow it; otherwise
                # the new worker must not run (it waits for our go-ahead, and
                # gets a cancel).
                got = self.delivered.text(self.request.api) if self.delivered else None
                if got is None or not self.delivered.pending:  # type: ignore[union-attr]
                    raise worker_lost()
                go = Continue(self.request.id, *got).encode()
            log.info("request %s %s on another worker (attempt %d)", self.request.id,
                     "continued" if self.wrote_chunks else "restarted", head.attempt)
            self.acks = AckPolicy(self.request.window_bytes, self.request.window_msgs)
            await self.ctx.publisher.publish(head.control, go)
        self.phase = Phase.STREAMING
        self.expected_seq = head.seq + 1
        self.gap_since = 0.0
        if head.job_seq:
            self.headers["x-tidegate-job-seq"] = str(head.job_seq)

    def _queue_note(self, position: int) -> bytes:
        """The client's place in its model's queue: an SSE comment, which every
        client ignores, or, when the request asked with the
        ``x-tidegate-queue-events`` header, an ``event: queue`` event."""
        if self.http.headers.get("x-tidegate-queue-events", "").lower() in ("1", "true"):
            return b'event: queue\ndata: {"position": %d}\n\n' % position
        return b": queued position=%d\n\n" % position

    def _collect(self, data: bytes) -> None:
        self.body_size += len(data)
        if self.body_size > self.ctx.config.edge.max_response_bytes:
            raise ApiError(502, f"The response exceeded the gateway's limit of "
                                f"{self.ctx.config.edge.max_response_bytes} bytes; use "
                                f"stream=true for long outputs.", type="server_error",
                           code="response_too_large")
        self.body_parts.append(data)

    # -- socket side ----------------------------------------------------------

    async def _start_stream(self) -> web.StreamResponse:
        response = web.StreamResponse(status=200, headers={**_SSE_HEADERS, **self.headers})
        await response.prepare(self.http)
        transport = self.http.transport
        if transport is not None:
            # Keep what sits in user space per connection small: _write then
            # waits whenever the client is not reading, and the ack (and so
            # the worker) waits with it.
            transport.set_write_buffer_limits(high=self.high_water, low=self.high_water // 2)
        self.response = response
        return response

    async def _write(self, data: bytes, *, last: bool = False) -> None:
        """Write and wait until the socket drains below the high-water mark;
        ``last`` ends the body with the same write (one system call, and one
        packet for the client, instead of two).

        Only a write that can block (it takes the buffer past high water) pays
        for a timeout scope; a client that does not drain within
        edge.slow_client_timeout is disconnected (``SlowClient``)."""
        response = self.response or await self._start_stream()
        self.last_write = time.monotonic()
        send = response.write_eof if last else response.write
        transport = self.http.transport
        if transport is None or transport.get_write_buffer_size() + len(data) <= self.high_water:
            await send(data)
            return
        writer = response._payload_writer  # aiohttp has no public drain on responses
        try:
            async with asyncio.timeout(self.ctx.config.edge.slow_client_timeout):
                await send(data)
                if writer is not None and not last:  # write_eof drains by itself
                    await writer.drain()
        except TimeoutError:
            transport.abort()
            raise SlowClient() from None

    def _direct_writer(self) -> Callable[[Chunk], bool] | None:
        """:meth:`_direct`, when this response can take raw chunked frames:
        headers sent, chunked transfer encoding (HTTP/1.1), no compression."""
        writer = self.response._payload_writer if self.response is not None else None
        if (writer is None or self.ids is not None or not isinstance(writer, StreamWriter)
                or not writer.chunked or not writer._headers_written
                or writer._compress is not None or writer.length is not None):
            return None
        return self._direct

    def _direct(self, chunk: Chunk) -> bool:
        """Write one chunk to the client from the NATS callback, bypassing the relay
        task and aiohttp's write path (one ``transport.write`` of the chunked frame).
        Only the steady state qualifies: the next chunk in sequence, room under the
        socket's high-water mark (drained, as in :meth:`_write`) and no ack due after
        it (acks publish: the task's job). Else False: the relay handles the chunk."""
        data = chunk.data
        n = len(data)
        if not n:
            return False  # an empty chunk frame would end the body: the relay skips it
        transport = self.http.transport
        if (chunk.seq != self.expected_seq or transport is None or transport.is_closing()
                or transport.get_write_buffer_size() + n > self.high_water
                or not self.acks.quiet_after(n)):
            return False
        # aiohttp's chunked framing, byte for byte; its write_eof ends the body.
        transport.write(b"%x\r\n%b\r\n" % (n, data))
        if self.delivered is not None:
            self.delivered.add(data)
        self.expected_seq = chunk.seq + 1
        self.acks.on_written(chunk.seq, n)
        self.last_worker_msg = self.last_write = time.monotonic()
        return True

    async def _finish(self) -> web.StreamResponse:
        if not self.request.stream:
            return web.Response(body=b"".join(self.body_parts), content_type="application/json",
                                headers=self.headers)
        # A Responses or Messages stream ends with its own terminal event
        # (response.completed, message_stop), never [DONE]: their APIs send none.
        await self._write(_DONE if self.request.api < Api.RESPONSES else b"", last=True)
        assert self.response is not None
        return self.response

