"""The relay and its writers, without a socket (issue 27, item 4).

:class:`edge.relay.Relay` decides and never touches a socket; each client
transport has its writer (``edge/writer.py``). Here the relay drives a
recording writer, the gRPC writer into a list and the WebSocket writer into
a fake socket: what each transport gets out of one session's messages. The
writers over real sockets: tests/test_relay_direct.py (SSE, the direct
path), tests/test_ws_pipeline.py and tests/test_grpc_pipeline.py."""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from edge.grpc_writer import NO_RESPONSE, GrpcWriter
from edge.relay import Relay, RelayContext
from edge.session import Session
from edge.writer import CANCEL_CODE, RawWrite, Writer, cancel_error
from edge.ws_writer import WsWriter
from tests.test_relay_direct import CONTROL, RecordingPublisher, make_request
from tidegate.config import Config
from tidegate.errors import ApiError
from tidegate.wire import gateway_pb2 as pb
from tidegate.wire.protocol import (
    Admission,
    Chunk,
    Done,
    Error,
    ErrorInfo,
    Head,
    Request,
    SessionMessage,
    Status,
)

RESPONSE = web.StreamResponse()
A = b'data: {"i": 1}\n\n'
B = b'data: {"i": 2}\n\n'


class RecordingWriter(Writer):
    """Every call the relay makes to its writer, in order."""

    __slots__ = ("calls",)

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    async def write(self, data: bytes, *, last: bool = False) -> None:
        self.calls.append(("write", data))

    def raw(self) -> RawWrite | None:
        return None

    async def finish(self, body_parts: list[bytes]) -> web.StreamResponse:
        self.calls.append(("finish", b"".join(body_parts)))
        return RESPONSE

    async def fail(self, error: ApiError) -> web.StreamResponse:
        self.calls.append(("fail", error.code))
        return RESPONSE

    def response(self) -> web.StreamResponse:
        return RESPONSE


def relay_over(out: Writer, request: Request, messages: list[SessionMessage],
               publisher: RecordingPublisher | None = None) -> Relay:
    session = Session(request.id, 0.1)
    for m in messages:
        session.feed(m)
    return Relay(out, session, request, RelayContext(Config(), publisher or RecordingPublisher()),
                 {"x-request-id": request.id})


def flowing(*, end: SessionMessage) -> list[SessionMessage]:
    return [Status(Admission.ADMITTED, headers={"x-ratelimit-remaining-requests": "9"}),
            Head(1, CONTROL, 7, 1), Chunk(2, A), Chunk(3, B), end]


async def test_the_relay_writes_through_its_writer_only() -> None:
    """One batch of two chunks is one write of their bytes; Done finishes."""
    out = RecordingWriter()
    relay = relay_over(out, make_request("r1"), flowing(end=Done(4, 5, 2, "stop")))
    assert await relay.run() is RESPONSE
    assert out.calls == [("write", A + B), ("finish", b"")]
    assert relay.headers["x-ratelimit-remaining-requests"] == "9"


async def test_a_non_streaming_body_reaches_the_writer_whole_at_the_end() -> None:
    out = RecordingWriter()
    relay = relay_over(out, make_request("r2", stream=False),
                       flowing(end=Done(4, 5, 2, "stop")))
    await relay.run()
    assert out.calls == [("finish", A + B)]


async def test_a_worker_error_after_output_writes_the_output_then_fails() -> None:
    out = RecordingWriter()
    info = ErrorInfo(502, "server_error", "backend_error", "The backend failed.")
    publisher = RecordingPublisher()
    relay = relay_over(out, make_request("r3"), flowing(end=Error(4, info)), publisher)
    await relay.run()
    assert out.calls == [("write", A + B), ("fail", "backend_error")]
    assert publisher.tombstones == []  # the worker ended it: nothing to cancel


async def test_a_client_cancel_fails_the_writer_and_cancels_upstream() -> None:
    out = RecordingWriter()
    publisher = RecordingPublisher()
    relay = relay_over(out, make_request("r4"), flowing(end=Chunk(4, A))[:-1], publisher)
    relay.session.abort(cancel_error())
    await relay.run()
    assert out.calls == [("fail", CANCEL_CODE)]
    # The reason readers of a stream's log read as a client's cancel.
    assert publisher.tombstones == [("r4", "client_cancel")]


class ListSink:
    def __init__(self) -> None:
        self.sent: list[pb.GenerateResponse] = []

    async def send(self, message: pb.GenerateResponse) -> None:
        self.sent.append(message)


async def test_the_grpc_writer_sends_accepted_queued_chunks_and_usage() -> None:
    sink = ListSink()
    request = make_request("r5")
    out = GrpcWriter(sink, "g1", request)
    queued = Status(Admission.QUEUED, position=3,
                    headers={"x-ratelimit-remaining-requests": "9"})
    messages: list[SessionMessage] = [queued,
                                      *flowing(end=Done(4, 5, 2, "stop"))]
    assert await relay_over(out, request, messages).run() is NO_RESPONSE
    kinds = [m.WhichOneof("event") for m in sink.sent]
    assert kinds == ["accepted", "queued", "chunk", "done"], kinds
    assert sink.sent[0].accepted.request_id == "r5"
    assert dict(sink.sent[0].accepted.ratelimit) == {"x-ratelimit-remaining-requests": "9"}
    assert sink.sent[1].queued.position == 3
    assert sink.sent[2].chunk.data == A + B  # the worker's bytes as they came
    assert sink.sent[3].done.usage.completion_tokens == 2
    assert out.failure is None
    assert all(m.id == "g1" for m in sink.sent)


async def test_the_grpc_writer_keeps_a_failure_for_the_call() -> None:
    sink = ListSink()
    request = make_request("r6")
    out = GrpcWriter(sink, "g1", request)
    info = ErrorInfo(502, "server_error", "backend_error", "The backend failed.")
    await relay_over(out, request, flowing(end=Error(4, info))).run()
    assert [m.WhichOneof("event") for m in sink.sent] == ["accepted", "chunk"]
    assert out.failure is not None
    assert out.failure.code == "backend_error"


class FakeSocket:
    """A FrameSink without a socket: frames are recorded, none goes raw."""

    def __init__(self) -> None:
        self.frames: list[dict[str, Any]] = []
        self.http: Any = None
        self.ws: Any = RESPONSE
        self.high_water = 4096
        self.raw = False

    async def send(self, payloads: list[bytes]) -> None:
        self.frames.extend(json.loads(p) for p in payloads)

    def sent(self, now: float) -> None:
        raise AssertionError("no direct write without raw")


async def test_the_ws_writer_frames_chunks_and_ends_with_done() -> None:
    sock = FakeSocket()
    request = make_request("r7")
    out = WsWriter(sock, "g2", request)
    relay = relay_over(out, request, flowing(end=Done(4, 5, 2, "stop")))
    await relay.run()
    types = [f["type"] for f in sock.frames]
    assert types == ["accepted", "chunk", "chunk", "done"], sock.frames
    assert [f["seq"] for f in sock.frames if f["type"] == "chunk"] == [1, 2]
    assert sock.frames[-1]["usage"]["completion_tokens"] == 2
    assert all(f["id"] == "g2" for f in sock.frames)


async def test_the_ws_writer_writes_no_frame_for_a_comment_and_a_cancelled_frame() -> None:
    sock = FakeSocket()
    out = WsWriter(sock, "g3", make_request("r8"))
    await out.write(b": ping\n\n")
    assert sock.frames == []
    await out.fail(cancel_error())
    await out.fail(ApiError(502, "lost", type="server_error", code="worker_lost"))
    assert [f["type"] for f in sock.frames] == ["cancelled", "error"]
    assert sock.frames[1]["error"]["code"] == "worker_lost"
