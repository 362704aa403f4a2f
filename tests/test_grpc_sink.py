"""edge.grpc_calls.CallSink: at most one write in grpc's core at a time, and
none left when the handler returns, however its senders are cancelled (the
fuzzer's GRPC_CALL_ERROR_TOO_MANY_OPERATIONS: a Session ending while a write
of one of its generations was in flight)."""

from __future__ import annotations

import asyncio

from edge.grpc_calls import CallSink
from tidegate.wire import gateway_pb2 as pb


class SlowContext:
    """A servicer context whose writes each take a while, as grpc's core does
    when HTTP/2 flow control has no room; it counts the writes in flight at
    once, as the core would refuse a second."""

    def __init__(self) -> None:
        self.in_flight = 0
        self.most = 0
        self.written: list[str] = []
        self.release = asyncio.Event()

    async def write(self, message: pb.GenerateResponse) -> None:
        self.in_flight += 1
        self.most = max(self.most, self.in_flight)
        try:
            await asyncio.shield(self.release.wait())  # the core's op: not taken back
        finally:
            self.in_flight -= 1
        self.written.append(message.id)


async def test_a_cancelled_senders_write_is_waited_for_not_overlapped() -> None:
    context = SlowContext()
    sink = CallSink(context)  # type: ignore[arg-type]
    first = asyncio.create_task(sink.send(pb.GenerateResponse(id="a")))
    await asyncio.sleep(0.01)
    first.cancel()  # its generation ends (the session's end, a cancel)
    second = asyncio.create_task(sink.send(pb.GenerateResponse(id="b")))
    await asyncio.sleep(0.01)
    assert context.in_flight == 1, "the second write waits for the first"
    context.release.set()
    await second
    assert context.most == 1
    assert context.written == ["a", "b"]


async def test_settle_waits_for_the_write_a_cancelled_sender_left() -> None:
    context = SlowContext()
    sink = CallSink(context)  # type: ignore[arg-type]
    sender = asyncio.create_task(sink.send(pb.GenerateResponse(id="a")))
    await asyncio.sleep(0.01)
    sender.cancel()
    settled = asyncio.create_task(sink.settle())
    await asyncio.sleep(0.01)
    assert not settled.done(), "the handler may not return with a write in the core"
    context.release.set()
    await settled
    assert context.in_flight == 0
    assert context.written == ["a"]
