"""One WebSocket generation: the SSE relay's session logic, frames instead of SSE.

:class:`WsRelay` is :class:`edge.relay.Relay` with its socket side replaced:
phases, sequence checks, acks after the write drained, deadlines, worker-lost
detection and upstream cancel are the relay's own code, run once per
generation. What differs is only where bytes go:

* chunk bytes (whole SSE events from the worker) are spliced into ``chunk``
  frames by :class:`tidegate.wire.ws.ChunkFramer`, never parsed;
* SSE comments (``: ping``, the queue note) write nothing: liveness is the
  socket's business (``edge.ws.WsSocket``), and the queue position goes out
  as a ``queued`` frame;
* admission sends ``accepted``, the end ``done`` with usage, a failure an
  ``error`` frame with the generation's id, an explicit cancel ``cancelled``.

A generation whose worker dies mid-stream is continued as an SSE stream is
(docs/resume.md, "Continuation"; the relay's ``delivered`` keeps the chunk
bytes on both write paths): the framer's ``seq`` runs on across the seam,
and ``done`` counts every token the client received.

Backpressure is per generation, as for SSE: each generation keeps its own
credit window, and acks only after its write left the socket buffer below
the high-water mark. Every generation of a socket shares that one buffer, so
a client that stops reading stops the acks of all of them, and each backend
is slowed; one that does not drain within ``edge.slow_client_timeout``
loses the socket (:class:`edge.relay.SlowClient`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Protocol

from aiohttp import web

from edge import instrument
from edge.endings import SlowClient
from edge.errors import to_info
from edge.generation_relay import GenerationRelay
from edge.relay import CLIENT_CANCEL, RelayContext
from edge.session import Session
from edge.stream import Phase
from tidegate.errors import ApiError
from tidegate.wire import streamlog
from tidegate.wire import ws as wire
from tidegate.wire.protocol import (
    Chunk,
    Done,
    Error,
    Request,
)

log = logging.getLogger("tidegate.edge")

# The error a client's cancel frame aborts its generation with: the relay's
# ApiError path then cancels upstream, as for any edge-side end.
CANCEL_CODE = "client_cancelled"


def cancel_error() -> ApiError:
    return ApiError(499, "Cancelled by the client.", type="invalid_request_error",
                    code=CANCEL_CODE)




class FrameSink(Protocol):
    """What a generation needs of its socket (``edge.ws.WsSocket``)."""

    http: web.Request
    ws: web.WebSocketResponse
    high_water: int
    raw: bool  # frames may go straight to the transport (no permessage-deflate)

    async def send(self, payloads: list[bytes]) -> None:
        """Write text frames; wait while the buffer is above high water."""

    def sent(self, now: float) -> None:
        """Frames went out through the direct path (for the keepalive)."""


class WsRelay(GenerationRelay):
    """Drives one generation of a socket; ``run`` returns when it ended."""

    __slots__ = ("framer", "sink")

    def __init__(self, sink: FrameSink, gen_id: str, session: Session, request: Request,
                 ctx: RelayContext, headers: dict[str, str]) -> None:
        super().__init__(sink.http, session, request, ctx, headers)
        self.sink = sink
        self.gen_id = gen_id
        self.framer = wire.ChunkFramer(gen_id)
        self.high_water = sink.high_water
        self.response = sink.ws  # frames go to the socket from the start: no HTTP phase
        self.announced = False
        self.done_msg: Done | None = None

    async def _send_accepted(self, ratelimit: dict[str, str]) -> None:
        await self.sink.send([wire.accepted(self.gen_id, self.request.id, ratelimit,
                                            resumable=self.request.resumable)])

    async def _send_queued(self, position: int) -> None:
        await self.sink.send([wire.queued(self.gen_id, position)])

    def _queue_note(self, position: int) -> bytes:
        return b": queued\n\n"  # a comment: no frame (the queued frame went out in _handle)

    async def _write(self, data: bytes, *, last: bool = False) -> None:
        self.last_write = time.monotonic()
        if data[:1] == b":":
            # An SSE comment (``: ping``, the queue note): no frame, and no
            # number either, or the next chunk's seq would skip one (a seam's
            # pause outlasts a heartbeat) and stop matching the log's ids.
            return
        frames = self.framer.frames(data)
        if frames:
            await self.sink.send(frames)

    def _direct_writer(self) -> Callable[[Chunk], bool] | None:
        return self._ws_direct if self.sink.raw else None

    def _ws_direct(self, chunk: Chunk) -> bool:
        """:meth:`Relay._direct` for a socket: the steady state's chunk goes
        out from the NATS callback as one transport write of its frames."""
        data = chunk.data
        n = len(data)
        transport = self.http.transport
        if (chunk.seq != self.expected_seq or transport is None or transport.is_closing()
                or transport.get_write_buffer_size() + n > self.high_water
                or not self.acks.quiet_after(n)):
            return False
        frames = self.framer.frames(data)
        if frames:
            transport.write(b"".join([wire.encode_text_frame(f) for f in frames]))
        if self.delivered is not None:  # failover = "continue": as Relay._direct
            self.delivered.add(data)
        self.expected_seq = chunk.seq + 1
        self.acks.on_written(chunk.seq, n)
        now = self.last_worker_msg = self.last_write = time.monotonic()
        self.sink.sent(now)
        return True

    async def _finish(self) -> web.StreamResponse:
        d = self.done_msg
        # A continued generation's last worker counts every token the client
        # received, the dead worker's too (workers/continuation.py).
        frame = (wire.done(self.gen_id, d.prompt_tokens, d.completion_tokens,
                           d.finish_reason)
                 if d is not None else wire.done(self.gen_id, 0, 0, ""))
        await self.sink.send([frame])
        return self.sink.ws

    async def _reconnect(self) -> None:
        """Edge draining (``edge.relay.Reconnect``), a resumable generation: it
        leaves this socket (the worker generates on into the log, within its
        grace) and the client is told where to pick it up, a ``reconnect``
        frame, instead of the SSE ``event: reconnect``."""
        try:
            await self.sink.send([wire.reconnect(self.gen_id, self.request.id,
                                                 self.framer.seq)])
        except (ConnectionError, RuntimeError, SlowClient):
            pass
        await self._leave("edge_draining")

    async def _cancel_upstream(self, reason: str) -> None:
        if reason == f"edge:{CANCEL_CODE}":
            reason = CLIENT_CANCEL  # as POST /v1/streams/{id}/cancel: log readers are told
        await super()._cancel_upstream(reason)

    async def _fail(self, error: ApiError) -> web.StreamResponse:
        if error.code in (CANCEL_CODE, "stream_cancelled"):
            frame = wire.cancelled(self.gen_id)
        else:
            instrument.failed(error)
            frame = wire.error(error, self.gen_id)
            if self.request.resumable and self.phase is not Phase.STREAMING:
                # As Relay._fail: no worker wrote to the log yet, so its
                # readers (a resume on another socket) learn the end here.
                try:
                    await self.ctx.publisher.publish(
                        streamlog.subject(self.ctx.config.nats.subjects, self.request.id),
                        Error(0, to_info(error)).encode())
                except Exception as exc:
                    log.warning("could not log the end of %s: %s", self.request.id, exc)
        try:
            await self.sink.send([frame])
        except (ConnectionError, RuntimeError):
            pass  # the socket is gone: nobody to tell
        return self.sink.ws
