"""One job: call the backend, stream its output to the edge under flow control.

Per job: this coroutine relays the backend, and two helper tasks it owns run a
watchdog (heartbeats, the ack timeout) and in-progress acks. Cancelling the job
closes the backend response, so the backend aborts and frees its KV cache.
Plain tasks, not a TaskGroup: on 3.11 a cancelled group holds the job in a cycle.

A job that stops before output is handed back (nak) for another worker; one
with output ends with a retryable error, unless the edge continues it
(workers/continuation.py) or another replica does (workers/replica_continuation.py).
Why jobs end and what each side is told: docs/lifecycle.md#a-workers-job.

Invariant: seq numbers are assigned and handed to NATS with no ``await`` in
between (wire order = seq order). Telemetry stays off the per-chunk path.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any, cast

from nats.aio.msg import Msg
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from tidegate import apis
from tidegate.control import prices
from tidegate.errors import ApiError, BackendError
from tidegate.telemetry import telemetry as tm
from tidegate.telemetry import tracing
from tidegate.wire.flow import SendWindow, first_seq
from tidegate.wire.protocol import (
    Admission,
    Continue,
    Done,
    Error,
    ErrorInfo,
    Head,
    Heartbeat,
    Request,
    UsageRecord,
    encode_chunk,
)
from tidegate.wire.protocol import Status as Standing
from workers.backends import Backend, BackendStream, PushStream, Usage
from workers.continuation import closing, continued, continued_stream
from workers.job_context import JobContext, ack, resend, reserved
from workers.job_state import (
    ACK_TIMEOUT,
    REQUEUE_DELAY,
    Ending,
    Event,
    JobState,
    Settle,
    cancelled,
)
from workers.limiter import AdaptiveLimit
from workers.replica_continuation import Continuation, continuable, go_on
from workers.replicas import ReplicaSet, open_on_replicas

log = logging.getLogger("tidegate.worker")

def _helper(coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
    """A job's helper task; a failure is logged (the job goes on without it:
    a lost watchdog leaves the edge's limits, a lost in-progress ack leaves
    redelivery, which the resume handshake keeps from running the job twice)."""
    task = asyncio.create_task(coro)
    task.add_done_callback(_log_helper_failure)
    return task


def _log_helper_failure(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("job helper task failed", exc_info=task.exception())


def _info(error: ApiError) -> ErrorInfo:
    return ErrorInfo(error.status, error.type, error.code or "", error.message,
                     error.retryable, error.retry_after)


class Job(JobState):
    # Called with every chunk message a resumable job sends (workers.resumable
    # sets it); None here, so a default job's chunk path only tests a local.
    _log_put: Callable[[bytes], None] | None = None
    # A model with several replicas (workers.replicas): the set and the
    # replica that pulled this job; a backend failure before output fails over.
    replicas: ReplicaSet | None = None
    replica = ""
    running = ""  # the replica whose backend call runs now
    continued: Continue | None = None  # the edge's go-ahead, when a Continue (workers.continuation)
    _origin: tuple[Request, str, int] | None = None  # ... the request before it, and its text
    # A continuable job on several replicas keeps what it sent (a reference
    # per chunk, in _account); None for every other job.
    _kept: Continuation | None = None
    _sent: list[bytes] | None = None

    def __init__(self, msg: Msg, request: Request, backend: Backend, ctx: JobContext,
                 limit: AdaptiveLimit | None = None) -> None:
        self.msg = msg
        self.request = request
        self.backend = backend
        self.ctx = ctx
        self.window = SendWindow(request.window_bytes, request.window_msgs)
        self._window_open = asyncio.Event()
        self._window_open.set()
        self._edge_confirmed = asyncio.Event()
        self.seq = 0
        self.chunks_sent = 0
        self.last_sent = time.monotonic()
        self.cancel_reason = ""
        self.task: asyncio.Task[None] | None = None
        self.stream: BackendStream | None = None
        self._start_state()  # phase HEAD, no outcome yet (workers.job_state)
        self.started = time.monotonic()
        self.queue_wait_ms = max(0.0, time.time() * 1000 - request.created_ms)
        self.first_chunk_at = 0.0
        self.last_ack_at = self.started  # the edge acks at least every ack_timeout/4
        self.stall_time = 0.0
        self.price: prices.Price | None = None  # the model's price, taken when the job starts
        self.span: Span | None = None
        self.attrs = {tm.MODEL: request.model, tm.OPERATION: apis.of(request.api).operation}
        # Every message to the edge goes one way, so the wire order is the seq order.
        self.outbox = ctx.outbox if request.mux else None
        self._end: asyncio.Future[None] | None = None  # set by a PushStream's end()
        self._pushing: PushStream | None = None
        self._stalled_at = 0.0  # when a pushed stream's window filled (0: open)
        # Adaptive concurrency (workers.limiter): this job's latency samples,
        # taken at the backend call, the first chunk and the end; never per chunk.
        self.limit = limit
        self._backend_at = 0.0  # when the backend call started
        self._mark = 0.0  # the limiter's in-flight integral at the last sample point

    def release(self) -> None:
        """Drop what the ended job points at. The job, its stream and the
        stream's response point at each other (sink, callbacks); cut here, the
        whole graph is freed by reference counting when the job ends instead
        of waiting for a full cyclic collection (see the module docstring)."""
        self.stream = None
        self.task = None
        self._end = None
        self._pushing = None

    # -- control messages from the edge (called by the worker's demux) -------

    def on_continue(self, go: Continue) -> None:
        if not self._edge_confirmed.is_set():  # a go-ahead that continues the delivered text
            self._origin = (self.request, go.text, go.tokens)
            self.request, self.continued = continued(self.request, go.text, go.tokens), go
        self.on_ack(0)

    def on_ack(self, seq: int) -> None:
        now = self.last_ack_at = time.monotonic()
        self._edge_confirmed.set()
        if self.window.on_ack(seq) and self.window.open:
            self._window_open.set()
            pushing = self._pushing
            if pushing is not None:
                if self._stalled_at:
                    self._stalled(now - self._stalled_at)
                    self._stalled_at = 0.0
                pushing.resume()

    async def on_retransmit(self, seq: int) -> None:
        """The edge lost messages from ``seq`` on: send every kept one again
        (to the edge only; the stream log already has them). Idempotent."""
        messages = [m for _, m in self.window.kept(seq)]
        if messages:
            log.info("job %s: resending %d messages from seq %d", self.request.id,
                     len(messages), seq)
            await resend(self.ctx, self.request, messages)

    def cancel(self, reason: str) -> None:
        if self.task is not None and not self.task.done() and not self.cancel_reason:
            self.cancel_reason = reason
            self.task.cancel()

    # -- the job ----------------------------------------------------------------

    async def run(self) -> None:
        if self.ctx.prices is not None:  # priced once: record, Done and usage chunk agree
            self.price, extra = self.ctx.prices.for_job(self.request.model, self.request.extra)
            self.request = dataclasses.replace(self.request, extra=extra)
        tel = self.ctx.telemetry
        if not tel.tracing:
            await self._run()
            return
        request = self.request
        span = self.span = tel.tracer.start_span(
            tracing.span_name(request, self.attrs[tm.OPERATION]), kind=SpanKind.CLIENT,
            context=tracing.parent_of(self.msg.headers, request),
            attributes={**tracing.request_attributes(request, self.attrs[tm.OPERATION]),
                        tracing.ATTEMPT: self.msg.metadata.num_delivered})
        # The backend's HTTP request continues this job's span, not the edge's.
        self.request = dataclasses.replace(request,
                                           extra={**request.extra, **tracing.inject(span)})
        try:
            await self._run()
        finally:
            span.end()

    async def _run(self) -> None:
        self.task = asyncio.current_task()
        progress = _helper(self._keep_in_progress())
        try:
            await self._relay()
        except asyncio.CancelledError:
            if not self.cancel_reason:
                raise  # cancelled from outside: leave the job unacked for redelivery
            # Our own targeted cancel of this job, not of the worker: the job
            # ends here, so the task must not stay marked as cancelling.
            assert self.task is not None
            self.task.uncancel()
            progress.cancel()
            await self._after_cancel()
            return
        finally:
            progress.cancel()
        await self._settle(self.ending())

    async def _settle(self, end: Ending) -> None:
        """Do what ``end`` says (workers.job_state.Ending), in its order:
        the record (or the metric alone), the error, the message's settling."""
        if end.report:
            await self._report(end.outcome)
        elif end.outcome:
            self.ctx.telemetry.metrics.jobs.add(1, {**self.attrs, tm.OUTCOME: end.outcome})
        if end.error is not None:  # the edge (or the log's readers) may still listen
            self.seq += 1
            await self._send(Error(self.seq, _info(end.error)).encode())
        if end.settle is Settle.ACK:
            await ack(self.ctx, self.request, self.msg)
        elif end.settle is Settle.NAK:
            await self.msg.nak()
        elif end.settle is Settle.REQUEUE:
            await self._requeue()

    async def _requeue(self) -> None:
        """A preempted batch line or stream (workers.preemption) goes back to
        JetStream: its runner or edge hears that it waits again (a ``QUEUED``
        status: not a silent worker), then its message is NAKed with
        :data:`REQUEUE_DELAY`, so the interactive request that wanted the slot
        gets it first. A later copy runs the line anew, or continues the
        stream's delivered text (its edge's ``Continue``)."""
        # Its last seq tells it from a dispatcher's (seq 0); never retransmitted.
        queued = Standing(Admission.QUEUED, seq=self.seq).encode()
        if self.outbox is not None:
            self.outbox.put(self.request.mux, self.request.id, queued)
        else:
            await self.ctx.nc.publish(self.request.reply, queued)
        log.info("job %s preempted; back in %gs", self.request.id, REQUEUE_DELAY)
        await self.msg.nak(delay=REQUEUE_DELAY)

    async def _report(self, outcome: str) -> None:
        usage = self.stream.usage if self.stream is not None else Usage()
        now = time.monotonic()
        request = self.request
        cost = prices.job_cost(self.price, outcome, usage.prompt_tokens,
                               usage.completion_tokens, usage.cached_tokens)
        record = UsageRecord(
            id=request.id, model=request.model, outcome=outcome, tenant=request.tenant,
            user=request.user, key_id=request.key_id, prompt_tokens=usage.prompt_tokens,
            completion_tokens=usage.completion_tokens, finish_reason=usage.finish_reason,
            queue_wait_ms=self.queue_wait_ms,
            ttft_ms=(self.first_chunk_at - self.started) * 1000 if self.first_chunk_at else 0.0,
            duration_ms=(now - self.started) * 1000, attempt=self.msg.metadata.num_delivered,
            reserved=reserved(self.msg), cached_tokens=usage.cached_tokens, cost_nanos=cost,
            currency=self.ctx.prices.currency if self.ctx.prices and self.price else "",
            operator_prompt_tokens=usage.operator_prompt_tokens)
        self._observe(record, now)
        await self.ctx.report(record)

    def _observe(self, record: UsageRecord, now: float) -> None:
        """The job's metrics and span attributes, from its usage record. Times
        count from the edge accepting the request (the record's queue wait
        plus the job's own times): what the client waited."""
        metrics = self.ctx.telemetry.metrics
        attrs = self.attrs
        outcome = record.outcome
        metrics.jobs.add(1, {**attrs, tm.OUTCOME: outcome})
        if record.cost_nanos:
            metrics.spend.add(record.cost_nanos / prices.NANO,
                              {tm.TENANT: record.tenant, tm.MODEL: record.model,
                               tm.CURRENCY: record.currency})
        queue_wait = record.queue_wait_ms / 1000
        metrics.queue_wait.record(queue_wait, attrs)
        if record.prompt_tokens:
            metrics.token_usage.record(record.prompt_tokens, {**attrs, tm.TOKEN_TYPE: "input"})
        if record.completion_tokens:
            metrics.token_usage.record(record.completion_tokens,
                                       {**attrs, tm.TOKEN_TYPE: "output"})
        if record.operator_prompt_tokens:
            metrics.operator_tokens.add(record.operator_prompt_tokens, {tm.MODEL: record.model})
        if self.first_chunk_at:
            metrics.time_to_first_token.record(queue_wait + record.ttft_ms / 1000, attrs)
            if outcome == "done" and record.completion_tokens > 1:
                metrics.time_per_output_token.record(
                    (now - self.first_chunk_at) / (record.completion_tokens - 1), attrs)
        duration = queue_wait + record.duration_ms / 1000
        if outcome == "done":
            metrics.request_duration.record(duration, attrs)
        else:
            metrics.request_duration.record(duration, {**attrs, tm.ERROR_TYPE: outcome})
        span = self.span
        if span is not None:
            span.set_attributes(tracing.usage_attributes(
                record.prompt_tokens, record.completion_tokens, record.finish_reason,
                self.chunks_sent))
            span.set_attributes({tm.OUTCOME: outcome, tracing.QUEUE_WAIT: queue_wait,
                                 tracing.STALL_TIME: self.stall_time})
            if outcome == "error":
                span.set_status(Status(StatusCode.ERROR, "backend_error"))

    async def _after_cancel(self) -> None:
        reason = self.cancel_reason
        log.info("job %s cancelled: %s (%d chunks sent)", self.request.id, reason,
                 self.chunks_sent)
        self.ctx.telemetry.metrics.cancellations.add(1, {tm.CAUSE: reason, tm.TIER: "worker"})
        if self.span is not None:
            self.span.add_event(tracing.CANCEL_EVENT, {tm.CAUSE: reason})
        await self._settle(cancelled(reason, self.chunks_sent))

    async def _send(self, payload: bytes) -> None:
        """Send a message outside the window (Head, heartbeat, Done, Error;
        ``self.seq`` is its seq), kept for a retransmit until acked."""
        self.last_sent = time.monotonic()
        self.window.hold(self.seq, payload)
        if self.outbox is not None:
            self.outbox.put(self.request.mux, self.request.id, payload)
        else:
            await self.ctx.nc.publish(self.request.reply, payload)

    async def _relay(self) -> None:
        # Head goes out before the backend call: the edge learns the control
        # subject (so a cancel during a long prefill reaches us directly) and
        # heartbeats cover the wait for the backend's first byte. The edge still
        # sends no HTTP headers before the first chunk or ping, so a backend
        # refusal remains a real HTTP status.
        metadata = self.msg.metadata
        self.last_ack_at = time.monotonic()
        self.seq = first_seq(metadata.num_delivered)  # this delivery's range of seqs
        await self._send(Head(self.seq, self.ctx.control_subject, metadata.sequence.stream,
                              metadata.num_delivered, self.msg.reply or "").encode())
        if metadata.num_delivered > 1 and not await self._edge_still_waiting():
            log.info("dropping redelivered job %s: its edge did not confirm", self.request.id)
            self.advance(Event.EDGE_SILENT)
            return
        self.advance(Event.GO_AHEAD)
        watchdog = _helper(self._watchdog())
        try:
            await self._call_backend()
        finally:
            watchdog.cancel()

    async def _edge_still_waiting(self) -> bool:
        """A redelivered job runs only if its edge confirms (Ack seq 0) that the
        client is still there and has received nothing; an edge that already
        wrote output answers with a Cancel instead, which cancels this task."""
        try:
            async with asyncio.timeout(self.ctx.config.worker.resume_timeout):
                await self._edge_confirmed.wait()
        except TimeoutError:
            return False
        return True

    async def _call_backend(self) -> None:
        limit = self.limit
        if limit is not None:
            now = self._backend_at = time.monotonic()
            self._mark = limit.mark(now)
        try:
            if self.ctx.owners is not None:  # previous_response_id: the tenant's own only
                await self.ctx.owners.check(self.request)
            if (ending := closing(self._origin, self.continued)) is not None:  # limit reached
                stream = self.stream = ending
            elif self.replicas is None:
                stream = self.stream = await self.backend.open(self.request)
            else:
                stream, self.backend, self.running = await open_on_replicas(
                    self.replicas, self.replica, self.request)
                self.stream = stream
                if self.running != self.replica:
                    self.limit = limit = None  # neither replica's latency alone
                replicas = self.replicas
                keeps = len(replicas.backends) > 1 and continuable(self.request, replicas.failover)
                kept = self._kept = Continuation(
                    *(self._origin or (self.request,)), keeps=keeps,
                    response_id=self.continued.response_id if self.continued else "")
                if keeps:
                    self._sent = kept.sent.parts
            if self.continued is not None:
                stream = self.stream = continued_stream(stream, self.request, self.continued)
        except BackendError as error:
            log.info("job %s: backend refused: %s", self.request.id, error.message)
            if limit is not None and error.status in (429, 503):
                limit.overload(time.monotonic())
            self.advance(Event.REFUSED)
            self.seq += 1
            await self._send(Error(self.seq, _info(error)).encode())
            return
        self.advance(Event.OPENED)
        while True:
            try:
                # A method lookup, not isinstance(): a runtime Protocol check
                # walks the protocol's members, per job.
                if self.outbox is not None and getattr(stream, "start", None) is not None:
                    failure = await self._push(cast(PushStream, stream))
                else:
                    failure = await self._pump(stream)
            finally:
                await stream.aclose()
            if failure is None:
                await self._done(stream)
                return
            following = None if self.replicas is None or self._kept is None else await go_on(
                self.replicas, self.replica, self.running, self.request, stream, failure,
                self._kept, sent=self.chunks_sent > 0, resumed=self.continued is not None)
            if following is None:
                await self._fail(failure)
                return
            self.advance(Event.FAILOVER)
            stream, self.backend, self.running = following
            self.stream, self.limit = stream, None  # neither replica's latency alone

    async def _push(self, stream: PushStream) -> BackendError | None:
        """The hot path: the stream calls :meth:`data` from its socket callback
        and this task only waits for the end. Messages go through the outbox,
        whose ``put`` does not await, so a chunk is handed to NATS in the same
        callback that read it."""
        self._end = asyncio.get_running_loop().create_future()
        self._pushing = stream
        stream.start(self)
        try:
            await self._end
        except BackendError as error:
            return error
        finally:
            self._pushing = None
        return None

    async def _pump(self, stream: BackendStream) -> BackendError | None:
        window = self.window
        read_bytes = self.ctx.config.worker.read_bytes
        publish, reply = self.ctx.nc.publish, self.request.reply
        outbox, mux, request_id = self.outbox, self.request.mux, self.request.id
        log_put = self._log_put
        try:
            while True:
                if not window.open:
                    # Backpressure: stop reading the backend until the edge
                    # acks; TCP then pushes back on the backend. The watchdog
                    # ends this wait if the acks never come.
                    stalled = time.monotonic()
                    try:
                        await self._window_open.wait()
                    finally:
                        self._stalled(time.monotonic() - stalled)
                data = await stream.read(min(read_bytes, window.available_bytes or read_bytes))
                if not data:
                    break
                message = self._account(data)
                if outbox is not None:
                    outbox.put(mux, request_id, message)
                else:
                    await publish(reply, message)
                if log_put is not None:
                    log_put(message)
        except BackendError as error:
            return error
        return None

    async def abort(self, error: ErrorInfo) -> None:
        """End the session with ``error`` after what was sent (a job that
        raised: ``tidegate.broker.poison``); nothing if it already ended."""
        if self.outcome:
            return
        self.advance(Event.ABORTED)
        self.seq += 1
        await self._send(Error(self.seq, error).encode())

    async def _fail(self, error: BackendError) -> None:
        log.info("job %s: backend failed mid-stream: %s", self.request.id, error.message)
        self.advance(Event.FAILED)
        self.seq += 1
        await self._send(Error(self.seq, _info(error)).encode())

    async def _done(self, stream: BackendStream) -> None:
        self.advance(Event.DONE)
        usage = stream.usage
        limit = self.limit
        if limit is not None and self.first_chunk_at:
            if self.request.stream:
                limit.tpot(self._mark, self.first_chunk_at, usage.completion_tokens,
                           time.monotonic(), stalled=self.stall_time)
            else:
                limit.whole(self._mark, self._backend_at, usage.completion_tokens,
                            time.monotonic(), stalled=self.stall_time)
        # Recorded before the Done: a client that has the end may follow up. A
        # continued answer's usage names no id (its calls' are joined): the Continue's.
        owners = self.ctx.owners
        if (owners is not None and apis.of(self.request.api).previous_field
                and (response_id := self._client_response_id(usage))):
            await owners.record(response_id, self.request.tenant)
        self.seq += 1
        cost = prices.format_money(prices.job_cost(
            self.price, "done", usage.prompt_tokens, usage.completion_tokens,
            usage.cached_tokens)) if self.price is not None else ""
        await self._send(Done(self.seq, usage.prompt_tokens, usage.completion_tokens,
                              usage.finish_reason, cost).encode())

    def _client_response_id(self, usage: Usage) -> str:
        """The response id the client saw: a continued response's first
        call's (later calls' ids are renamed to it), else the backend's."""
        kept = self._kept.response_id if self._kept is not None else ""
        return kept or (self.continued.response_id if self.continued else "") or usage.response_id

    def _account(self, data: bytes) -> bytes:
        """A chunk is about to go out: its seq, its message (kept in the window
        for a retransmit), the first-chunk time. Per-chunk path: one clock
        read, no envelope object; the caller hands the message over directly
        (not through _send)."""
        now = self.last_sent = time.monotonic()
        seq = self.seq = self.seq + 1
        if not self.chunks_sent:
            self.first_chunk_at = now
            if self.span is not None:
                self.span.add_event(tracing.FIRST_TOKEN_EVENT)
            limit = self.limit
            if limit is not None and self.request.stream:  # see AdaptiveLimit.whole
                limit.ttfb(self._mark, self._backend_at, now)
                self._mark = limit.mark(now)
        self.chunks_sent += 1
        sent = self._sent
        if sent is not None:  # a continuable job on replicas: a reference, no copy
            sent.append(data)
        message = encode_chunk(seq, data)
        if not self.window.on_send(seq, len(data), now, message):
            self._window_open.clear()
            self._stalled_at = now  # read by on_ack for a pushed stream only
        return message

    # -- Sink: what a PushStream calls, from its socket callback -------------------

    def credit(self) -> int:
        return self.window.credit

    def data(self, data: bytes) -> None:
        message = self._account(data)
        assert self.outbox is not None
        self.outbox.put(self.request.mux, self.request.id, message)

    def end(self, error: BackendError | None) -> None:
        end = self._end
        if end is None or end.done():
            return
        if error is None:
            end.set_result(None)
        else:
            end.set_exception(error)

    def _stalled(self, seconds: float) -> None:
        self.stall_time += seconds
        self.ctx.telemetry.metrics.stall_duration.record(seconds, self.attrs)

    async def _watchdog(self) -> None:
        """Heartbeats while nothing else is sent; cancels the job when the edge
        has not acknowledged anything for the ack timeout (edge dead, client
        stuck). A live edge acks at least every ack_timeout/4, output or not,
        so this also frees the slot of a long prefill whose edge died."""
        session = self.ctx.config.session
        interval = session.heartbeat_interval
        tick = min(interval, session.ack_timeout / 4)
        while True:
            await asyncio.sleep(min(tick, max(0.0, self.last_sent + interval - time.monotonic())))
            now = time.monotonic()
            if now - self.last_ack_at >= session.ack_timeout and self._ack_timed_out():
                return
            self._on_tick(now)
            if now - self.last_sent >= interval:
                self.seq += 1
                await self._send(Heartbeat(self.seq).encode())

    def _ack_timed_out(self) -> bool:
        """No ack for the ack timeout: cancel (True: the watchdog stops)."""
        self.cancel(ACK_TIMEOUT)
        return True

    def _on_tick(self, now: float) -> None:
        """Once per watchdog tick (a resumable job expires its readers here)."""

    async def _keep_in_progress(self) -> None:
        interval = self.ctx.config.worker.ack_wait / 3
        while True:
            await asyncio.sleep(interval)
            await self.msg.in_progress()
