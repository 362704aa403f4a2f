"""One gRPC generation: the SSE relay's session logic, protobuf messages out.

:class:`GrpcRelay` is :class:`edge.relay.Relay` with its socket side
replaced, as :class:`edge.ws_relay.WsRelay` is: phases, sequence checks,
acks after the write, deadlines, worker-lost detection and upstream cancel
are the relay's own code. What differs is where bytes go:

* chunk bytes (whole SSE events from the worker, or a non-streaming
  request's JSON body) become the ``data`` of a ``Chunk`` message as they are;
  nothing is parsed or re-encoded;
* SSE comments (``: ping``, the queue note) write nothing: liveness is
  HTTP/2's (keepalive pings), and the queue position goes out as ``Queued``;
* admission sends ``Accepted``, the end ``Done`` with usage; a failure is
  left in :attr:`GrpcRelay.failure` for the call to end with a status
  (Generate) or an ``Error`` message (Session).

Backpressure is HTTP/2's per-stream flow control: ``sink.send`` awaits the
call's write, which completes only when the message fits the peer's window,
and the relay acks the worker only after it. A reader that stops reading
stops the acks, and the worker stops at its window (the backend with it). A
write that does not complete within ``edge.slow_client_timeout`` drops the
call (:class:`edge.relay.SlowClient`), as a socket that does not drain.
"""

from __future__ import annotations

import logging
import time
from typing import Protocol, cast

from aiohttp import web

from edge import instrument
from edge.endings import Reconnect, SlowClient
from edge.errors import to_info
from edge.generation_relay import GenerationRelay
from edge.relay import CLIENT_CANCEL, RelayContext
from edge.session import Session
from edge.stream import Phase
from tidegate.errors import ApiError
from tidegate.wire import gateway_pb2 as pb
from tidegate.wire import streamlog
from tidegate.wire.protocol import Done, Error, Request

log = logging.getLogger("tidegate.edge")

# The error a Session's cancel aborts its generation with (the relay's
# ApiError path then cancels upstream, as for any edge-side end).
CANCEL_CODE = "client_cancelled"
_PING = b": ping\n\n"


def cancel_error() -> ApiError:
    return ApiError(499, "Cancelled by the client.", type="invalid_request_error",
                    code=CANCEL_CODE)


class _NoHttp:
    """Stands in for the aiohttp request a gRPC call does not have: every
    method of :class:`Relay` that would read it is overridden below."""

    headers: dict[str, str] = {}
    transport = None


_NO_HTTP = cast(web.Request, _NoHttp())
# Relay.run returns "the response"; a gRPC call has none (the messages went
# out through the sink), so every relay returns this placeholder.
NO_RESPONSE = web.StreamResponse()


class MessageSink(Protocol):
    """Where a generation's messages go (one call, or one id on a Session)."""

    async def send(self, message: pb.GenerateResponse) -> None:
        """Write one message; waits for flow control, at most
        edge.slow_client_timeout (then raises :class:`SlowClient`)."""


class GrpcRelay(GenerationRelay):
    """Drives one generation; ``run`` returns when it ended, and
    :attr:`failure` says how it failed (None: ``Done`` went out)."""

    __slots__ = ("events", "failure", "sink")

    def __init__(self, sink: MessageSink, gen_id: str, session: Session, request: Request,
                 ctx: RelayContext, headers: dict[str, str]) -> None:
        super().__init__(_NO_HTTP, session, request, ctx, headers)
        self.sink = sink
        self.gen_id = gen_id
        self.response = NO_RESPONSE  # messages go to the call from the start
        self.announced = False
        self.done_msg: Done | None = None
        self.failure: ApiError | None = None
        # Chunk bytes go out as the worker wrote them, never with SSE ``id:``
        # lines; a resumable stream's event numbers travel in Chunk.seq instead.
        self.ids = None
        session.resumable = request.resumable and request.stream
        self.events = 0  # events written (a resumable stream's last event id)

    async def _send_accepted(self, ratelimit: dict[str, str]) -> None:
        await self.sink.send(pb.GenerateResponse(id=self.gen_id, accepted=pb.Accepted(
            request_id=self.request.id, resumable=self.request.resumable,
            ratelimit=ratelimit)))

    async def _send_queued(self, position: int) -> None:
        await self.sink.send(pb.GenerateResponse(id=self.gen_id, queued=pb.Queued(
            position=position)))

    def _queue_note(self, position: int) -> bytes:
        return b""  # nothing: the Queued message went out in _handle

    async def _write(self, data: bytes, *, last: bool = False) -> None:
        if not data or data == _PING:
            return  # HTTP/2 keeps the connection alive; comments are SSE's
        self.last_write = time.monotonic()
        if self.request.resumable:
            self.events += len(streamlog.split_events(data))
        await self.sink.send(pb.GenerateResponse(
            id=self.gen_id, chunk=pb.Chunk(data=data, seq=self.events)))

    def _direct_writer(self) -> None:
        return None  # a gRPC write needs the task (it awaits flow control)

    async def _finish(self) -> web.StreamResponse:
        if not self.request.stream:
            await self.sink.send(pb.GenerateResponse(
                id=self.gen_id, chunk=pb.Chunk(data=b"".join(self.body_parts))))
            self.body_parts.clear()
        d = self.done_msg
        usage = (pb.Usage(prompt_tokens=d.prompt_tokens,
                          completion_tokens=d.completion_tokens,
                          finish_reason=d.finish_reason) if d is not None else pb.Usage())
        await self.sink.send(pb.GenerateResponse(id=self.gen_id, done=pb.Done(usage=usage)))
        return NO_RESPONSE

    async def _reconnect(self) -> None:
        """Edge draining, a resumable generation: it leaves this call (the
        worker generates on into the log, within its grace) and the client is
        told where to pick it up: a ``Reconnect`` message, then (Generate) the
        status UNAVAILABLE ``edge_reconnect``."""
        self.failure = Reconnect()
        try:
            await self.sink.send(pb.GenerateResponse(id=self.gen_id, reconnect=pb.Reconnect(
                request_id=self.request.id, after=self.events)))
        except (ConnectionError, RuntimeError, SlowClient):
            pass
        await self._leave("edge_draining")

    async def _cancel_upstream(self, reason: str) -> None:
        if reason == f"edge:{CANCEL_CODE}":
            reason = CLIENT_CANCEL  # as POST /v1/streams/{id}/cancel: log readers are told
        await super()._cancel_upstream(reason)

    async def _fail(self, error: ApiError) -> web.StreamResponse:
        if error.code not in (CANCEL_CODE, "stream_cancelled"):
            instrument.failed(error)
            if self.request.resumable and self.phase is not Phase.STREAMING:
                # As Relay._fail: no worker wrote to the log yet, so its
                # readers (a resume on another call) learn the end here.
                try:
                    await self.ctx.publisher.publish(
                        streamlog.subject(self.ctx.config.nats.subjects, self.request.id),
                        Error(0, to_info(error)).encode())
                except Exception as exc:
                    log.warning("could not log the end of %s: %s", self.request.id, exc)
        self.failure = error
        return NO_RESPONSE
