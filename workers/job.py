"""One job: call the backend, stream its output to the edge under flow control.

Per job, inside one TaskGroup: the backend relay (this coroutine), a heartbeat
task (the backend may be silent for long: prefill, its own queue) and an
in-progress ack task (so JetStream does not redeliver a long but healthy
generation). Cancelling the job task - client gone, worker stopping - closes
the backend response at once, which is what makes the backend abort the
generation and free its KV cache.

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

from tidegate.config import Config
from tidegate.errors import BackendError
from tidegate.flow import SendWindow
from tidegate.protocol import Chunk, Done, Error, ErrorInfo, Head, Heartbeat, Request
from workers.backends import Backend, BackendStream

log = logging.getLogger("tidegate.worker")


@dataclass(frozen=True, slots=True)
class JobContext:
    """What every job of one worker process shares."""

    config: Config
    nc: NATS
    control_subject: str


def _info(error: BackendError) -> ErrorInfo:
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
        self.seq = 0
        self.last_sent = time.monotonic()
        self.cancel_reason = ""
        self.task: asyncio.Task[None] | None = None

    # -- control messages from the edge (called by the worker's demux) -------

    def on_ack(self, seq: int) -> None:
        if self.window.on_ack(seq) and self.window.open:
            self._window_open.set()

    def cancel(self, reason: str) -> None:
        if self.task is not None and not self.task.done() and not self.cancel_reason:
            self.cancel_reason = reason
            self.task.cancel()

    # -- the job ----------------------------------------------------------------

    async def run(self) -> None:
        self.task = asyncio.current_task()
        request = self.request
        try:
            async with asyncio.TaskGroup() as tg:
                progress = tg.create_task(self._keep_in_progress())
                try:
                    await self._relay()
                finally:
                    progress.cancel()
        except asyncio.CancelledError:
            if not self.cancel_reason:
                raise  # the worker is stopping: leave the job unacked for redelivery
            # Our own targeted cancel of this job, not of the worker: the job
            # ends here, so the task must not stay marked as cancelling.
            if self.task is not None:
                self.task.uncancel()
            log.info("job %s cancelled: %s", request.id, self.cancel_reason)
            await self.msg.ack()
            return
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
        self.seq = 1
        await self._send(Head(1, self.ctx.control_subject,
                              self.msg.metadata.sequence.stream).encode())
        async with asyncio.TaskGroup() as tg:
            heartbeat = tg.create_task(self._heartbeat())
            try:
                await self._call_backend()
            finally:
                heartbeat.cancel()

    async def _call_backend(self) -> None:
        try:
            stream = await self.backend.open(self.request)
        except BackendError as error:
            log.info("job %s: backend refused: %s", self.request.id, error.message)
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
                    await self._window_open.wait()
                data = await stream.read(min(read_bytes, window.available_bytes or read_bytes))
                if not data:
                    break
                self.seq += 1
                window.on_send(self.seq, len(data))
                if not window.open:
                    self._window_open.clear()
                await self._send(Chunk(self.seq, data).encode())
        except BackendError as error:
            log.info("job %s: backend failed mid-stream: %s", self.request.id, error.message)
            self.seq += 1
            await self._send(Error(self.seq, _info(error)).encode())
            return
        usage = stream.usage
        self.seq += 1
        await self._send(Done(self.seq, usage.prompt_tokens, usage.completion_tokens,
                              usage.finish_reason).encode())

    async def _heartbeat(self) -> None:
        interval = self.ctx.config.session.heartbeat_interval
        while True:
            await asyncio.sleep(max(0.0, self.last_sent + interval - time.monotonic()))
            if time.monotonic() - self.last_sent >= interval:
                self.seq += 1
                await self._send(Heartbeat(self.seq).encode())

    async def _keep_in_progress(self) -> None:
        interval = self.ctx.config.worker.ack_wait / 3
        while True:
            await asyncio.sleep(interval)
            await self.msg.in_progress()
