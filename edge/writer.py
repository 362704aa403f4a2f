"""The socket side of one relay: where a stream's bytes go, and how its
beginning and its ends look on the wire.

:class:`edge.relay.Relay` decides (sequence, acks, phases, deadlines, cancel); a
:class:`Writer` writes, knowing nothing of workers or acks. One per transport:
:class:`edge.sse_writer.SseWriter`, :class:`edge.ws_writer.WsWriter`,
:class:`edge.grpc_writer.GrpcWriter` (the last two on
:class:`edge.generation_writer.GenerationWriter`).

Hot path: a writer that can take a chunk straight to its socket from the NATS
callback returns a :data:`RawWrite` from :meth:`Writer.raw`; the relay checks
the stream's side (next seq, no ack due), the writer its socket's (room under
high water). Docs: docs/lifecycle.md#the-edges-relay.
"""

from __future__ import annotations

from collections.abc import Callable

from aiohttp import web

from tidegate.errors import ApiError
from tidegate.wire.protocol import SessionMessage

# The error a client's cancel frame (WebSocket) or message (gRPC Session)
# aborts its generation with: the relay's ApiError path then cancels
# upstream, as for any edge-side end.
CANCEL_CODE = "client_cancelled"
# The error codes of a client's own cancel, not a failure: POST
# /v1/streams/{id}/cancel (any transport) and :data:`CANCEL_CODE`.
CANCEL_CODES = ("stream_cancelled", CANCEL_CODE)


def cancel_error() -> ApiError:
    return ApiError(499, "Cancelled by the client.", type="invalid_request_error",
                    code=CANCEL_CODE)

# One chunk's bytes to the socket at once, at a time.monotonic() the relay
# read: False when the socket has no room (the relay then writes them with
# its own path, which waits).
RawWrite = Callable[[bytes, float], bool]


class Writer:
    """What every writer answers (see the module docstring); the defaults
    are those of a connection without an HTTP phase."""

    __slots__ = ()

    # Whether :meth:`notice` wants to see the session's messages first.
    announces = False
    # Whether a resumable stream's SSE events go out numbered (``id:`` lines):
    # false where the transport numbers them itself (gRPC's Chunk.seq).
    numbers_events = True
    # The socket's buffer past which a write waits for the client; 0 where
    # the transport has its own flow control (gRPC).
    high_water = 0

    @property
    def started(self) -> bool:
        """Whether the client saw the stream begin (its status is sent)."""
        return True

    async def start(self) -> None:
        """Begin the stream before its first bytes (a resumable stream's
        request id goes out once it is admitted)."""

    async def notice(self, messages: list[SessionMessage], headers: dict[str, str]) -> None:
        """See a batch of session messages before the relay handles them
        (only when :attr:`announces`)."""

    async def write(self, data: bytes, *, last: bool = False) -> None:
        """Write ``data`` (whole SSE events or comments) and wait while the
        client does not drain (:class:`edge.endings.SlowClient` past
        edge.slow_client_timeout); ``last`` ends the stream's body with it."""
        raise NotImplementedError

    def raw(self) -> RawWrite | None:
        """The direct path's write for this stream, now, or None (the relay's
        task writes everything)."""
        return None

    def queue_note(self, position: int) -> bytes:
        """What a stream writes while it waits in its model's queue."""
        return b""

    async def finish(self, body_parts: list[bytes]) -> web.StreamResponse:
        """End a stream that completed; ``body_parts``: a non-streaming
        request's body. Returns what the route returns to aiohttp."""
        raise NotImplementedError

    async def fail(self, error: ApiError) -> web.StreamResponse:
        """End the stream with ``error`` (the relay has cancelled upstream
        and told the stream's log)."""
        raise NotImplementedError

    async def reconnect(self, request_id: str, last_event_id: int) -> None:
        """Tell the client where to resume a stream this edge lets go
        (``last_event_id``: the last numbered event it got)."""
        raise NotImplementedError

    def response(self) -> web.StreamResponse:
        """What the route returns to aiohttp once the stream ended."""
        raise NotImplementedError
