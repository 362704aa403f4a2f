"""One HTTP response of the relay: SSE for a stream, one JSON body otherwise.

Headers go out with the first chunk, the first ``: ping`` of a long wait, or the
admission of a resumable stream; until then a failure is a real HTTP status,
afterwards a final SSE error event (``edge.errors``).

Backpressure: the socket's user-space buffer is capped at the stream's high
water (a quarter of its ack window, at least 4 KiB); a write past it waits for
the client to drain, and the relay's ack and the worker wait with it. A client
that does not drain within ``edge.slow_client_timeout`` is disconnected. The
direct path (:meth:`SseWriter.raw`) writes aiohttp's own chunked frame from the
NATS callback (``edge.raw_http``). Docs: docs/lifecycle.md#credit-window-flow-control.
"""

from __future__ import annotations

import asyncio

from aiohttp import web

from edge.endings import SlowClient, reconnect_event
from edge.errors import error_response, sse_error_event
from edge.raw_http import payload_writer, takes_raw_chunks
from edge.writer import RawWrite, Writer
from tidegate import apis
from tidegate.config import Config
from tidegate.errors import ApiError
from tidegate.wire.protocol import Request

_DONE = b"data: [DONE]\n\n"
_SSE_HEADERS = {
    "Content-Type": "text/event-stream; charset=utf-8",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",
}


class SseWriter(Writer):
    """Writes one request's response to its HTTP connection."""

    # One per open stream, 10,000 of them on an edge: no per-instance dict.
    __slots__ = ("_response", "api", "headers", "high_water", "http", "numbered",
                 "retry_ms", "slow_after", "stream")

    def __init__(self, http: web.Request, request: Request, headers: dict[str, str],
                 config: Config) -> None:
        self.http = http
        # The relay's headers, the same dict: it adds to them (admission's
        # rate limits, the cost) until the response starts.
        self.headers = headers
        self.api = request.api
        self.stream = request.stream
        self.numbered = request.resumable and request.stream
        self.high_water = max(4096, request.window_bytes // 4)
        self.slow_after = config.edge.slow_client_timeout
        self.retry_ms = config.resume.retry_ms
        self._response: web.StreamResponse | None = None

    @property
    def started(self) -> bool:
        return self._response is not None

    async def start(self) -> None:
        await self._start()

    async def _start(self) -> web.StreamResponse:
        response = web.StreamResponse(status=200, headers={**_SSE_HEADERS, **self.headers})
        await response.prepare(self.http)
        transport = self.http.transport
        if transport is not None:
            # Keep what sits in user space per connection small: write then
            # waits whenever the client is not reading, and the ack (and so
            # the worker) waits with it.
            transport.set_write_buffer_limits(high=self.high_water, low=self.high_water // 2)
        self._response = response
        return response

    async def write(self, data: bytes, *, last: bool = False) -> None:
        """One write; ``last`` ends the body with it (one system call, and one
        packet for the client, instead of two). Only a write that can block
        (it takes the buffer past high water) pays for a timeout scope."""
        response = self._response or await self._start()
        send = response.write_eof if last else response.write
        transport = self.http.transport
        if transport is None or transport.get_write_buffer_size() + len(data) <= self.high_water:
            await send(data)
            return
        writer = payload_writer(response)  # aiohttp has no public drain on responses
        try:
            async with asyncio.timeout(self.slow_after):
                await send(data)
                if writer is not None and not last:  # write_eof drains by itself
                    await writer.drain()
        except TimeoutError:
            transport.abort()
            raise SlowClient() from None

    def raw(self) -> RawWrite | None:
        """:meth:`_raw`, when this response can take raw chunked frames:
        headers sent, chunked transfer encoding (HTTP/1.1), no compression,
        and no event numbers to add."""
        response = self._response
        if response is None or self.numbered or not takes_raw_chunks(response):
            return None
        return self._raw

    def _raw(self, data: bytes, now: float) -> bool:
        n = len(data)
        transport = self.http.transport
        if (transport is None or transport.is_closing()
                or transport.get_write_buffer_size() + n > self.high_water):
            return False
        # aiohttp's chunked framing, byte for byte; its write_eof ends the body.
        transport.write(b"%x\r\n%b\r\n" % (n, data))
        return True

    def queue_note(self, position: int) -> bytes:
        """The client's place in its model's queue: an SSE comment, which every
        client ignores, or, when the request asked with the
        ``x-tidegate-queue-events`` header, an ``event: queue`` event."""
        if self.http.headers.get("x-tidegate-queue-events", "").lower() in ("1", "true"):
            return b'event: queue\ndata: {"position": %d}\n\n' % position
        return b": queued position=%d\n\n" % position

    async def finish(self, body_parts: list[bytes]) -> web.StreamResponse:
        if not self.stream:
            return web.Response(body=b"".join(body_parts), content_type="application/json",
                                headers=self.headers)
        # A Responses or Messages stream ends with its own terminal event
        # (response.completed, message_stop), never [DONE]: their APIs send none.
        await self.write(_DONE if apis.of(self.api).done_marker else b"", last=True)
        return self.response()

    async def fail(self, error: ApiError) -> web.StreamResponse:
        if self._response is None:
            response = error_response(error, self.api)
            # Request id and rate-limit headers on errors too (a 429 needs x-ratelimit-*).
            response.headers.update(self.headers)
            return response
        try:
            await self._response.write(sse_error_event(error, self.api))
            await self._response.write_eof()
        except (ConnectionError, RuntimeError):
            pass
        return self._response

    async def reconnect(self, request_id: str, last_event_id: int) -> None:
        await self.write(reconnect_event(request_id, last_event_id, self.retry_ms), last=True)

    def response(self) -> web.StreamResponse:
        assert self._response is not None
        return self._response
