"""One job: call the backend, stream its output to the edge under flow control.

Per job, inside one TaskGroup: the backend relay (this coroutine), a watchdog
(heartbeats while the backend is silent, and the ack timeout) and an
in-progress ack task (so JetStream does not redeliver a long but healthy
generation). Cancelling the job task closes the backend response at once,
which is what makes the backend abort the generation and free its KV cache.

Why a job ends early, and what the edge and JetStream are told:

=====================  ==============================  =====================
cancel reason          edge                            job message
=====================  ==============================  =====================
client gone (edge)     nothing (it asked)              ack
``ack_timeout``        Error (it may still listen)     ack
``worker_shutdown``    nothing / Error if output sent  nak / ack
redelivered, no edge   nothing                         ack
=====================  ==============================  =====================

A job that stops before sending output is handed back (nak) so another worker
runs it transparently; once output has reached the edge, it can only end with
a retryable error, never run a second time.

Sequence numbers: Head is 1; every later message (chunk, heartbeat, done,
error) takes the next one. A seq is assigned and its message handed to the
NATS client with no ``await`` in between, so the wire order is the seq order.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from tidegate.config import Config
from tidegate.errors import ApiError, BackendError
from tidegate.flow import SendWindow
from tidegate.protocol import (
    Chunk,
    Done,
    Error,
    ErrorInfo,
    Head,
    Heartbeat,
    Request,
    UsageRecord,
)
from workers.backends import Backend, BackendStream, Usage

log = logging.getLogger("tidegate.worker")

WORKER_SHUTDOWN = "worker_shutdown"
ACK_TIMEOUT = "ack_timeout"


@dataclass(frozen=True, slots=True)
class JobContext:
    """What every job of one worker process shares."""

    config: Config
    nc: NATS
    js: JetStreamContext
    control_subject: str

    async def report(self, record: UsageRecord) -> None:
        """Publish a usage record; a broker hiccup costs an accounting entry
        (the reservation then expires), never the job's answer."""
        try:
            await self.js.publish(self.config.nats.subjects.usage(record.model),
                                  record.encode(), headers={"Nats-Msg-Id": f"u-{record.id}"})
        except Exception as exc:
            log.warning("could not publish usage for %s: %s", record.id, exc)


def _info(error: ApiError) -> ErrorInfo:
    return ErrorInfo(error.status, error.type, error.code or "", error.message,
                     error.retryable, error.retry_after)


class Job:
    def __init__(self, msg: Msg, request: Request, backend: Backend, ctx: JobContext) -> None:
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
        self.outcome = ""  # "done" | "error" once the job reached its end
        self.started = time.monotonic()
        self.queue_wait_ms = max(0.0, time.time() * 1000 - request.created_ms)
        self.first_chunk_at = 0.0
        self.last_ack_at = self.started  # the edge acks at least every ack_timeout/4

    # -- control messages from the edge (called by the worker's demux) -------

    def on_ack(self, seq: int) -> None:
        self.last_ack_at = time.monotonic()
        self._edge_confirmed.set()
        if self.window.on_ack(seq) and self.window.open:
            self._window_open.set()

    def cancel(self, reason: str) -> None:
        if self.task is not None and not self.task.done() and not self.cancel_reason:
            self.cancel_reason = reason
            self.task.cancel()

    # -- the job ----------------------------------------------------------------

    async def run(self) -> None:
        self.task = asyncio.current_task()
        try:
            async with asyncio.TaskGroup() as tg:
                progress = tg.create_task(self._keep_in_progress())
                try:
                    await self._relay()
                finally:
                    progress.cancel()
        except asyncio.CancelledError:
            if not self.cancel_reason:
                raise  # cancelled from outside: leave the job unacked for redelivery
            # Our own targeted cancel of this job, not of the worker: the job
            # ends here, so the task must not stay marked as cancelling.
            assert self.task is not None
            self.task.uncancel()
            await self._after_cancel()
            return
        if self.outcome:
            await self._report(self.outcome)
        await self.msg.ack()

    async def _report(self, outcome: str) -> None:
        usage = self.stream.usage if self.stream is not None else Usage()
        now = time.monotonic()
        request = self.request
        await self.ctx.report(UsageRecord(
            id=request.id, model=request.model, outcome=outcome, tenant=request.tenant,
            user=request.user, key_id=request.key_id, prompt_tokens=usage.prompt_tokens,
            completion_tokens=usage.completion_tokens, finish_reason=usage.finish_reason,
            queue_wait_ms=self.queue_wait_ms,
            ttft_ms=(self.first_chunk_at - self.started) * 1000 if self.first_chunk_at else 0.0,
            duration_ms=(now - self.started) * 1000, attempt=self.msg.metadata.num_delivered))

    async def _after_cancel(self) -> None:
        reason = self.cancel_reason
        log.info("job %s cancelled: %s (%d chunks sent)", self.request.id, reason,
                 self.chunks_sent)
        if reason == WORKER_SHUTDOWN and not self.chunks_sent:
            await self.msg.nak()  # nothing reached the client: another worker takes over
            return
        await self._report("cancelled")
        if reason in (WORKER_SHUTDOWN, ACK_TIMEOUT):
            message = ("The worker running this request is shutting down." if
                       reason == WORKER_SHUTDOWN else
                       "The client stopped acknowledging output; the request was cancelled.")
            error = ApiError(503, message, type="server_error", code=reason, retryable=True,
                             retry_after=1)
            self.seq += 1
            await self._send(Error(self.seq, _info(error)).encode())
        await self.msg.ack()

    async def _send(self, payload: bytes) -> None:
        self.last_sent = time.monotonic()
        await self.ctx.nc.publish(self.request.reply, payload)

    async def _relay(self) -> None:
        # Head goes out before the backend call: the edge learns the control
        # subject (so a cancel during a long prefill reaches us directly) and
        # heartbeats cover the wait for the backend's first byte. The edge still
        # sends no HTTP headers before the first chunk or ping, so a backend
        # refusal remains a real HTTP status.
        metadata = self.msg.metadata
        self.last_ack_at = time.monotonic()
        self.seq = 1
        await self._send(Head(1, self.ctx.control_subject, metadata.sequence.stream,
                              metadata.num_delivered).encode())
        if metadata.num_delivered > 1 and not await self._edge_still_waiting():
            log.info("dropping redelivered job %s: its edge did not confirm", self.request.id)
            self.outcome = "dropped"
            return
        async with asyncio.TaskGroup() as tg:
            watchdog = tg.create_task(self._watchdog())
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
        try:
            stream = self.stream = await self.backend.open(self.request)
        except BackendError as error:
            log.info("job %s: backend refused: %s", self.request.id, error.message)
            self.outcome = "error"
            self.seq += 1
            await self._send(Error(self.seq, _info(error)).encode())
            return
        try:
            await self._pump(stream)
        finally:
            await stream.aclose()

    async def _pump(self, stream: BackendStream) -> None:
        window = self.window
        read_bytes = self.ctx.config.worker.read_bytes
        try:
            while True:
                if not window.open:
                    # Backpressure: stop reading the backend until the edge
                    # acks; TCP then pushes back on the backend. The watchdog
                    # ends this wait if the acks never come.
                    await self._window_open.wait()
                data = await stream.read(min(read_bytes, window.available_bytes or read_bytes))
                if not data:
                    break
                self.seq += 1
                if not self.chunks_sent:
                    self.first_chunk_at = time.monotonic()
                self.chunks_sent += 1
                window.on_send(self.seq, len(data), time.monotonic())
                if not window.open:
                    self._window_open.clear()
                await self._send(Chunk(self.seq, data).encode())
        except BackendError as error:
            log.info("job %s: backend failed mid-stream: %s", self.request.id, error.message)
            self.outcome = "error"
            self.seq += 1
            await self._send(Error(self.seq, _info(error)).encode())
            return
        self.outcome = "done"
        usage = stream.usage
        self.seq += 1
        await self._send(Done(self.seq, usage.prompt_tokens, usage.completion_tokens,
                              usage.finish_reason).encode())

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
            if now - self.last_ack_at >= session.ack_timeout:
                self.cancel(ACK_TIMEOUT)
                return
            if now - self.last_sent >= interval:
                self.seq += 1
                await self._send(Heartbeat(self.seq).encode())

    async def _keep_in_progress(self) -> None:
        interval = self.ctx.config.worker.ack_wait / 3
        while True:
            await asyncio.sleep(interval)
            await self.msg.in_progress()
