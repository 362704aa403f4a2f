"""One WebSocket generation's frames: the relay's stream, frames instead of SSE.

:class:`edge.relay.Relay` drives the generation as an SSE stream; :class:`WsWriter`
says where bytes go: chunk bytes are spliced into ``chunk`` frames
(:class:`tidegate.wire.ws.ChunkFramer`, never parsed); SSE comments write
nothing (the queue position is a ``queued`` frame); admission sends ``accepted``,
the end ``done``, a failure ``error``, a cancel ``cancelled``. A continued
generation's ``seq`` runs on across the seam.

Backpressure is per generation, over one shared socket buffer: a client that
stops reading stops every generation's acks; one that does not drain within
``edge.slow_client_timeout`` loses the socket. Docs: docs/websocket.md#backpressure.
"""

from __future__ import annotations

from typing import Protocol

from aiohttp import web

from edge.generation_writer import GenerationWriter
from edge.writer import CANCEL_CODES, RawWrite
from tidegate.errors import ApiError
from tidegate.wire import ws as wire
from tidegate.wire.protocol import Request


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


class WsWriter(GenerationWriter):
    """Writes one generation of a socket."""

    __slots__ = ("framer", "high_water", "request_id", "resumable", "sink")

    def __init__(self, sink: FrameSink, gen_id: str, request: Request) -> None:
        super().__init__(gen_id)
        self.sink = sink
        self.request_id = request.id
        self.resumable = request.resumable
        self.framer = wire.ChunkFramer(gen_id)
        self.high_water = sink.high_water

    async def _send_accepted(self, ratelimit: dict[str, str]) -> None:
        await self.sink.send([wire.accepted(self.gen_id, self.request_id, ratelimit,
                                            resumable=self.resumable)])

    async def _send_queued(self, position: int) -> None:
        await self.sink.send([wire.queued(self.gen_id, position)])

    async def write(self, data: bytes, *, last: bool = False) -> None:
        if data[:1] == b":":
            # An SSE comment (``: ping``, the queue note): no frame, and no
            # number either, or the next chunk's seq would skip one (a seam's
            # pause outlasts a heartbeat) and stop matching the log's ids.
            return
        frames = self.framer.frames(data)
        if frames:
            await self.sink.send(frames)

    def raw(self) -> RawWrite | None:
        return self._raw if self.sink.raw else None

    def _raw(self, data: bytes, now: float) -> bool:
        """The direct path's write: the chunk's frames as one transport write."""
        transport = self.sink.http.transport
        if (transport is None or transport.is_closing()
                or transport.get_write_buffer_size() + len(data) > self.high_water):
            return False
        frames = self.framer.frames(data)
        if frames:
            transport.write(b"".join([wire.encode_text_frame(f) for f in frames]))
        self.sink.sent(now)
        return True

    async def finish(self, body_parts: list[bytes]) -> web.StreamResponse:
        d = self.done_msg
        # A continued generation's last worker counts every token the client
        # received, the dead worker's too (workers/continuation.py).
        frame = (wire.done(self.gen_id, d.prompt_tokens, d.completion_tokens,
                           d.finish_reason)
                 if d is not None else wire.done(self.gen_id, 0, 0, ""))
        await self.sink.send([frame])
        return self.sink.ws

    async def reconnect(self, request_id: str, last_event_id: int) -> None:
        """A ``reconnect`` frame instead of the SSE ``event: reconnect``; its
        ``after`` is the framer's count of chunk frames sent."""
        await self.sink.send([wire.reconnect(self.gen_id, request_id, self.framer.seq)])

    async def fail(self, error: ApiError) -> web.StreamResponse:
        frame = (wire.cancelled(self.gen_id) if error.code in CANCEL_CODES
                 else wire.error(error, self.gen_id))
        try:
            await self.sink.send([frame])
        except (ConnectionError, RuntimeError):
            pass  # the socket is gone: nobody to tell
        return self.sink.ws

    def response(self) -> web.StreamResponse:
        return self.sink.ws
