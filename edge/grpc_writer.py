"""One gRPC generation's messages: the relay's stream, protobuf messages out.

:class:`GrpcWriter` is where :class:`edge.relay.Relay` puts bytes for a gRPC
generation: chunk bytes become a ``Chunk``'s ``data`` unparsed; SSE comments
write nothing (HTTP/2 keepalive does liveness; a queue position is
``Queued``); admission sends ``Accepted``, the end ``Done``; a failure is left in
:attr:`GrpcWriter.failure` for the call to end with.

Backpressure is HTTP/2 flow control: ``sink.send`` completes only when the
message fits the peer's window, and the relay acks the worker after it. A write
stuck past ``edge.slow_client_timeout`` drops the call
(:class:`edge.endings.SlowClient`). Docs: docs/grpc.md.
"""

from __future__ import annotations

from typing import Protocol

from aiohttp import web

from edge.endings import Reconnect
from edge.generation_writer import GenerationWriter
from tidegate.errors import ApiError
from tidegate.wire import gateway_pb2 as pb
from tidegate.wire import streamlog
from tidegate.wire.protocol import Request

_PING = b": ping\n\n"
# Relay.run returns "the response"; a gRPC call has none (the messages went
# out through the sink), so every relay returns this placeholder.
NO_RESPONSE = web.StreamResponse()


class MessageSink(Protocol):
    """Where a generation's messages go (one call, or one id on a Session)."""

    async def send(self, message: pb.GenerateResponse) -> None:
        """Write one message; waits for flow control, at most
        edge.slow_client_timeout (then raises :class:`SlowClient`)."""


class GrpcWriter(GenerationWriter):
    """Writes one generation to its call; :attr:`failure` says how it failed
    (None: ``Done`` went out)."""

    __slots__ = ("events", "failure", "request_id", "resumable", "sink", "stream")

    # Chunk bytes go out as the worker wrote them, never with SSE ``id:``
    # lines; a resumable stream's event numbers travel in Chunk.seq instead.
    numbers_events = False

    def __init__(self, sink: MessageSink, gen_id: str, request: Request) -> None:
        super().__init__(gen_id)
        self.sink = sink
        self.request_id = request.id
        self.resumable = request.resumable
        self.stream = request.stream
        self.failure: ApiError | None = None
        self.events = 0  # events written (a resumable stream's last event id)

    async def _send_accepted(self, ratelimit: dict[str, str]) -> None:
        await self.sink.send(pb.GenerateResponse(id=self.gen_id, accepted=pb.Accepted(
            request_id=self.request_id, resumable=self.resumable, ratelimit=ratelimit)))

    async def _send_queued(self, position: int) -> None:
        await self.sink.send(pb.GenerateResponse(id=self.gen_id, queued=pb.Queued(
            position=position)))

    async def write(self, data: bytes, *, last: bool = False) -> None:
        if not data or data == _PING:
            return  # HTTP/2 keeps the connection alive; comments are SSE's
        if self.resumable:
            self.events += len(streamlog.split_events(data))
        await self.sink.send(pb.GenerateResponse(
            id=self.gen_id, chunk=pb.Chunk(data=data, seq=self.events)))

    # raw(): None, the base's: a gRPC write needs the task (it awaits flow control).

    async def finish(self, body_parts: list[bytes]) -> web.StreamResponse:
        if not self.stream:
            await self.sink.send(pb.GenerateResponse(
                id=self.gen_id, chunk=pb.Chunk(data=b"".join(body_parts))))
            body_parts.clear()
        d = self.done_msg
        usage = (pb.Usage(prompt_tokens=d.prompt_tokens,
                          completion_tokens=d.completion_tokens,
                          finish_reason=d.finish_reason) if d is not None else pb.Usage())
        await self.sink.send(pb.GenerateResponse(id=self.gen_id, done=pb.Done(usage=usage)))
        return NO_RESPONSE

    async def reconnect(self, request_id: str, last_event_id: int) -> None:
        """A ``Reconnect`` message (its ``after``: the events written), then
        (Generate) the status UNAVAILABLE ``edge_reconnect``."""
        self.failure = Reconnect()
        await self.sink.send(pb.GenerateResponse(id=self.gen_id, reconnect=pb.Reconnect(
            request_id=request_id, after=self.events)))

    async def fail(self, error: ApiError) -> web.StreamResponse:
        self.failure = error
        return NO_RESPONSE

    def response(self) -> web.StreamResponse:
        return NO_RESPONSE
