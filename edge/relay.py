"""One request's response, from session messages to its client.

:class:`Relay` extends :class:`edge.stream.StreamState` (the state without
I/O) with what its answers ask for: publishes to NATS (acks, retransmits,
cancels, hand-backs) and writes through the stream's :class:`edge.writer.Writer`.
The relay never touches a socket itself.

Hot path: a batch of chunk messages is one write of their bytes, never parsed;
acks go back after the write drained, at most once per half window. Once a
stream flows, the NATS callback writes most chunks itself
(:meth:`Relay._direct`) and the relay wakes only for acks, ticks, a full
socket buffer and other messages. Docs: docs/lifecycle.md#the-edges-relay.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from aiohttp import web

from edge import instrument
from edge.continuation import Delivered, continuable, worker_gone
from edge.endings import Reconnect, SlowClient, worker_lost
from edge.errors import from_info, to_info
from edge.logreader import StreamLog
from edge.session import BAD_INPUT, Session
from edge.stream import Due, Phase, StreamState
from edge.writer import CANCEL_CODES, RawWrite, Writer
from tidegate import apis
from tidegate.broker.link import Link
from tidegate.broker.liveness import WorkerWatch
from tidegate.config import DEFAULT_FAILOVER, Config, ModelConfig
from tidegate.errors import ApiError, unavailable
from tidegate.wire import streamlog
from tidegate.wire.flow import AckPolicy
from tidegate.wire.protocol import (
    DUPLICATE_DELIVERY,
    Ack,
    Admission,
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

CLIENT_CANCEL = "client_cancel"  # workers.job_state.CLIENT_CANCEL: readers get a final event

_PING = b": ping\n\n"


def _no_room(data: bytes, now: float) -> bool:
    return False


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
    watch: WorkerWatch | None = None  # the edge's worker liveness probe (tidegate.broker.liveness)
    models: Mapping[str, ModelConfig] = field(default_factory=dict)  # failover per model
    streamlog: StreamLog | None = None  # resumable streams' logs, to refill (LiveTail)


class Relay(StreamState):
    """Drives one request through ``out``, its writer. ``run`` returns the
    response aiohttp should finish (a WebSocket or gRPC generation's is its
    connection's or a placeholder: its messages went out through ``out``).
    ``headers``: the response's, which admission and the end add to; an
    SSE writer holds the same dict."""
    # One per open stream, 10,000 of them on an edge: no per-instance dict.
    __slots__ = ("acks", "body_parts", "body_size", "continues_in_log", "control", "ctx",
                 "delivered", "failover", "handed_back", "head_key", "headers", "ids",
                 "job_ack", "out", "raw", "request", "session", "tail", "upstream_done",
                 "wrote_chunks")

    def __init__(self, out: Writer, session: Session, request: Request,
                 ctx: RelayContext, headers: dict[str, str]) -> None:
        super().__init__(request.id, time.monotonic())
        self.out = out
        self.raw: RawWrite = _no_room  # the direct path's write (the writer's, once on)
        self.session = session
        self.request = request
        self.ctx = ctx
        self.headers = headers
        self.control = ""  # worker control subject, once known
        self.job_ack = ""  # the job message's JetStream ack subject (Head.ack)
        model = ctx.models.get(request.model)
        self.failover = model.failover if model is not None else DEFAULT_FAILOVER
        # failover = "continue": what the client got, for the next worker; a
        # resumable stream's is in its log, where the next worker reads it.
        can = continuable(request, model)
        self.delivered = Delivered(request.api) if can and not request.resumable else None
        self.continues_in_log = can and request.resumable
        self.handed_back = False  # its worker died: the job is the next worker's
        self.link_epoch = ctx.link.epoch
        self.acks = AckPolicy(request.window_bytes, request.window_msgs)
        self.head_key: tuple[str, int, int] | None = None
        self.wrote_chunks = False
        self.body_parts: list[bytes] = []
        self.body_size = 0
        self.upstream_done = False  # the worker/dispatcher ended it: nothing to cancel
        # A resumable stream numbers its SSE events (tidegate.wire.streamlog);
        # None for every other request, whose bytes go out as they came, and
        # where the transport numbers them itself (gRPC). The first event's
        # block also says how long an EventSource waits to reconnect (not on
        # a Responses stream: its events carry sequence_number, and the SDK
        # needs none).
        session.resumable = request.resumable and request.stream
        # What the client got last: the log may lack it when the worker dies
        # (refill_log). None once stored, and for a stream with no log.
        self.tail = streamlog.LiveTail() if request.resumable else None
        self.ids = (streamlog.EventIds(
            b"" if apis.of(request.api).numbered_events
            else streamlog.retry_field(ctx.config.resume.retry_ms))
            if session.resumable and out.numbers_events else None)

    async def run(self) -> web.StreamResponse:
        finished = False
        try:
            response = await self._relay()
            finished = True
            return response
        except Reconnect:
            finished = True
            await self._reconnect()
            return self.out.response()
        except ApiError as error:
            finished = True
            await self._cancel_upstream(CLIENT_CANCEL if error.code in CANCEL_CODES
                                        else f"edge:{error.code or error.type}")
            return await self._fail(error)
        except SlowClient:
            finished = True
            log.info("request %s: client did not drain for %.0fs; disconnected", self.request.id,
                     self.ctx.config.edge.slow_client_timeout)
            await self._leave("slow_client")
            return self.out.response()
        finally:
            if not finished:
                # Client went away (handler cancelled) or an unexpected error:
                # whatever runs upstream for this request is now waste, unless
                # the stream is resumable and the client may come back.
                await self._leave("client_disconnected")

    async def _reconnect(self) -> None:
        """End a resumable stream with the reconnect event (frame, message),
        and detach: the worker generates on, and the client resumes on
        another edge."""
        self.last_write = time.monotonic()
        try:
            await self.out.reconnect(self.request.id,
                                     self.ids.last if self.ids is not None else 0)
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

    async def refill_log(self) -> None:
        """Store what the client got and the log lacks, once this stream's
        worker is taken for dead (LiveTail); at most once. Best effort: a
        failure leaves the log as the worker left it (a later reader ends at
        its gap)."""
        tail, log_ = self.tail, self.ctx.streamlog
        self.tail = None
        if tail is None or log_ is None or not tail:
            return
        try:
            await log_.refill(self.request.id, tail)
        except Exception as exc:
            log.warning("could not refill the log of %s: %s", self.request.id, exc)

    async def _fail(self, error: ApiError) -> web.StreamResponse:
        if error.code not in CANCEL_CODES:  # a client's own cancel is no failure
            instrument.failed(error)
        if error.code == "worker_lost" and self.phase is Phase.STREAMING:
            await self.refill_log()  # the silence limit's end (worker_gone refilled its own)
        if self.request.resumable and self.phase is not Phase.STREAMING:
            # No worker wrote to the log yet: the log's readers learn the end here.
            try:
                await self.ctx.publisher.publish(
                    streamlog.subject(self.ctx.config.nats.subjects, self.request.id),
                    Error(0, to_info(error)).encode())
            except Exception as exc:
                log.warning("could not log the end of %s: %s", self.request.id, exc)
        return await self.out.fail(error)

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
                    return await self.out.finish(self.body_parts)
                if self.wrote_chunks:
                    session.direct = self._direct_writer()
            if session.lost:
                await worker_gone(self, session.lost, now)
            if session.take_tick():
                await self._on_tick(now)

    async def _on_tick(self, now: float) -> None:
        """The clock's rules (:meth:`edge.stream.StreamState.clock`), run about
        once a second per request (not per chunk), and the I/O they ask for."""
        link = self.ctx.link
        due = self.clock(now, self.ctx.config, model=self.request.model,
                         link_lost=link.lost(now), resumable=self.ids is not None,
                         stream=self.request.stream, control=self.control,
                         link_epoch=link.epoch)
        if due & Due.RETRANSMIT:
            await self._ask_retransmit(now)
        if due & Due.PING:
            await self._write(_PING)
        if due & Due.ACK:
            await self._ack(self.acks.ack_now())

    async def _handle(self, messages: list[SessionMessage], now: float) -> bool:
        """Apply a batch of session messages; True once the response is complete."""
        if self.out.announces:
            await self.out.notice(messages, self.headers)
        out: list[bytes] = []
        nbytes = 0
        last_chunk = 0
        done = False
        ping = False
        stale = self.stale
        failed: ErrorInfo | None = None
        tail = self.tail
        for m in messages:
            kind = type(m)
            if kind is Chunk:
                assert isinstance(m, Chunk)
                if not self.check_seq(m.seq):
                    continue
                if tail is not None:
                    tail.add(m)
                out.append(m.data)
                nbytes += len(m.data)
                last_chunk = m.seq
            elif kind is Heartbeat:
                assert isinstance(m, Heartbeat)
                if self.check_seq(m.seq):
                    ping = True
                    if tail is not None:
                        tail.add(m)
            elif kind is Head:
                assert isinstance(m, Head)
                await self._on_head(m)
            elif kind is Done:
                assert isinstance(m, Done)
                if self.check_seq(m.seq):
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
                if m.seq:  # a worker's, not a dispatcher's: it gave the slot away
                    self._requeued(m.seq)
                    continue
                if m.headers:
                    self.headers.update(m.headers)
                if m.admission is Admission.REJECTED:
                    self.upstream_done = True
                    raise from_info(m.error) if m.error else unavailable("Rejected.")
                self.advance(Status)
                if m.admission is Admission.QUEUED and m.position and self.request.stream:
                    note = self.out.queue_note(m.position)
                    if note:
                        await self._write(note)
                elif self.ids is not None and not self.out.started and self.request.stream:
                    # A resumable stream's 200 and request id go out once it
                    # is admitted (quota passed): a client whose edge dies
                    # before the first token can then resume it elsewhere.
                    await self.out.start()

        if self.gap_since:
            await self._ask_retransmit(now)
        elif self.copies:
            self.copies = False
            if self.acks.acked_seq:
                await self._ack(self.acks.acked_seq)
        if out:
            data = out[0] if len(out) == 1 else b"".join(out)
            if self.request.stream:
                if self.delivered is not None:
                    self.delivered.add(data)
                ids = self.ids
                if ids is not None:
                    data = ids.frame(data)
                # _write inline: one coroutine frame less per batch (hot path)
                self.last_write = time.monotonic()
                await self.out.write(data)
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
        if self.stale != stale:
            # An earlier delivery's output, sent late (flow.first_seq):
            # dropped by check_seq / _on_head, counted here (off the chunk path).
            BAD_INPUT.drop("session", "earlier_delivery",
                           f"{self.request.id}: {self.stale - stale} message(s)")
        if failed is not None:
            raise from_info(failed)
        return done

    # -- message handling --------------------------------------------------------

    async def _ask_retransmit(self, now: float) -> None:
        """Ask the worker to send everything from the first missing seq again;
        at most every 0.25 s (a burst of messages past one gap asks once)."""
        if not self.retransmit_due(now):
            return
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

    def _worker_lives(self) -> bool:
        """Whether the worker this stream follows is known alive: the edge's
        WorkerWatch follows it and has not found it gone. With the probe off
        nothing tells a live worker from a dead one, and a later Head takes
        the stream over, as the heartbeat rule alone would have it."""
        watch = self.ctx.watch
        return (watch is not None and watch.enabled and bool(self.control)
                and self.session.worker == self.control)

    async def _cancel_second_delivery(self, head: Head) -> None:
        """A second worker got this stream's job while the first still runs
        it (JetStream redelivered it: see ``DUPLICATE_DELIVERY``). The stream
        stays the first worker's; the second is told to drop its copy, which
        it does before calling its backend (it waits for this edge's word)."""
        log.info("request %s: job delivered again (attempt %d) while worker %s still "
                 "streams it; the copy on %s is cancelled", self.request.id, head.attempt,
                 self.control, head.control)
        try:
            await self.ctx.publisher.publish(
                head.control, Cancel(self.request.id, DUPLICATE_DELIVERY).encode())
        except Exception as exc:  # unconfirmed, the copy drops itself at worker.resume_timeout
            log.warning("could not cancel the second delivery of %s: %s", self.request.id, exc)

    def _requeued(self, seq: int) -> None:
        """This attempt's worker gave the stream's slot to a heavier tier's
        request (workers.preemption) and NAKed the job itself: as after its
        death, the next worker's Head gets a ``Continue`` with the delivered
        text, and its silence limit waits for that worker."""
        if (self.phase is not Phase.STREAMING or seq < self.floor_seq or self.upstream_done
                or self.delivered is None):
            return  # not streaming, an earlier attempt's, or nothing kept to continue
        log.info("request %s: its worker %s gave the slot away; waiting for the next",
                 self.request.id, self.control)
        self.delivered.pending = True
        self.handed_back = True
        self.session.unfollow()  # alive, but no longer this stream's worker

    async def _on_head(self, head: Head) -> None:
        key = (head.control, head.job_seq, head.attempt)
        if self.phase is Phase.STREAMING and key == self.head_key:
            return  # the same Head again (the worker resent what was not acked)
        if head.seq < self.floor_seq:
            # An earlier delivery's Head, sent late (flow.first_seq): the
            # stream follows a later one. If that copy still runs, it stops.
            self.stale += 1
            if head.control != self.control:
                await self._cancel_second_delivery(head)
            return
        if (self.phase is Phase.STREAMING and head.control != self.control
                and self._worker_lives()):
            await self._cancel_second_delivery(head)
            return
        if (self.phase is Phase.STREAMING and head.control == self.control
                and head.attempt > 1 and self.wrote_chunks and not self.handed_back
                and self._worker_lives()):
            # The same live worker got the job again, so it no longer runs the
            # first copy: that one ended there, and what it sent last (its
            # last chunks, its Done) was lost in transit with the acks behind
            # it (a NATS node's death). Its tail still holds them: drop the
            # copy and ask for them. Were they gone too, the silence limit
            # ends the stream with worker_lost, as a second Head did at once.
            await self._cancel_second_delivery(head)
            self.asked_at = 0.0  # now, whatever the last ask
            await self._ask_retransmit(time.monotonic())
            return
        self.head_key = key
        self.control = head.control  # from now on, cancels go to this worker
        self.job_ack = head.ack if head.ack.startswith("$JS.ACK.") else ""
        if self.ctx.watch is not None:
            self.session.follow(self.ctx.watch, head.control)
        if head.attempt > 1 or self.phase is Phase.STREAMING:
            go = Ack(self.request.id, 0).encode()
            if self.body_size and self.failover != "off":
                self.body_parts, self.body_size = [], 0  # none of it reached the client
            if self.wrote_chunks and self.continues_in_log and self.handed_back:
                # The next worker continues the stream in its log; the client
                # resumes there (from the last event it got), told to now.
                log.info("request %s continues on another worker (attempt %d); its client "
                         "resumes from the stream log", self.request.id, head.attempt)
                await self.ctx.publisher.publish(head.control,
                                                 Continue(self.request.id, "", 0).encode())
                raise Reconnect()
            if self.wrote_chunks or self.body_size:
                # Redelivered after output reached the client: only a
                # continuation of the delivered text may follow it; otherwise
                # the new worker must not run (it waits for our go-ahead, and
                # gets a cancel).
                got = self.delivered.text(self.request.api) if self.delivered else None
                if got is None or not self.delivered.pending:  # type: ignore[union-attr]
                    log.info("request %s: attempt %d on %s after output (worker %s, %s); "
                             "ends with worker_lost", self.request.id, head.attempt,
                             head.control, self.control,
                             "handed back" if self.handed_back else
                             "alive" if self._worker_lives() else "not followed")
                    raise worker_lost()
                go = Continue(self.request.id, *got).encode()
            log.info("request %s %s on another worker (attempt %d)", self.request.id,
                     "continued" if self.wrote_chunks else "restarted", head.attempt)
            self.acks = AckPolicy(self.request.window_bytes, self.request.window_msgs)
            await self.ctx.publisher.publish(head.control, go)
        self.advance(Head)
        self.floor_seq = head.seq
        self.expected_seq = head.seq + 1
        self.gap_since = 0.0
        if head.job_seq:
            self.headers["x-tidegate-job-seq"] = str(head.job_seq)

    def _collect(self, data: bytes) -> None:
        self.body_size += len(data)
        if self.body_size > self.ctx.config.edge.max_response_bytes:
            raise ApiError(502, f"The response exceeded the gateway's limit of "
                                f"{self.ctx.config.edge.max_response_bytes} bytes; use "
                                f"stream=true for long outputs.", type="server_error",
                           code="response_too_large")
        self.body_parts.append(data)

    # -- the writer's side ------------------------------------------------------

    async def _write(self, data: bytes, *, last: bool = False) -> None:
        self.last_write = time.monotonic()
        await self.out.write(data, last=last)

    def _direct_writer(self) -> Callable[[Chunk], bool] | None:
        """:meth:`_direct`, when the writer can take chunks from the NATS
        callback now (:meth:`edge.writer.Writer.raw`)."""
        raw = self.out.raw()
        if raw is None:
            return None
        self.raw = raw
        return self._direct

    def _direct(self, chunk: Chunk) -> bool:
        """Write one chunk to the client from the NATS callback, bypassing the
        relay task. Only the steady state qualifies: the next chunk in
        sequence, no ack due after it (acks publish: the task's job) and room
        in the socket's buffer (the writer's check). Else False: the relay
        handles the chunk."""
        data = chunk.data
        n = len(data)
        if (not n  # an empty chunk frame would end an SSE body: the relay skips it
                or chunk.seq != self.expected_seq or not self.acks.quiet_after(n)):
            return False
        now = time.monotonic()
        if not self.raw(data, now):
            return False
        if self.delivered is not None:
            self.delivered.add(data)
        if self.tail is not None:
            self.tail.add(chunk)
        self.expected_seq = chunk.seq + 1
        self.acks.on_written(chunk.seq, n)
        self.last_worker_msg = self.last_write = now
        return True
