"""The WebSocket ``resume`` frame: a resumable stream's log, as frames.

``{"type": "resume", "id": ..., "request_id": ..., "after": N}`` follows the
rules of ``GET /v1/streams/{request_id}``: the caller's tenant only (404
otherwise), any edge, any socket; the events after N, then the live tail
(``edge.logreader``). Each event is one ``chunk`` frame whose ``seq`` is the
event's id, so a client resuming after its last ``seq`` neither loses nor
repeats one. At the edge's drain the replay ends with a ``reconnect`` frame
naming the last event sent. Docs: docs/websocket.md#resume.
"""

from __future__ import annotations

from edge.errors import from_info
from edge.logreader import Draining, LogReader
from edge.writer import CANCEL_CODES
from edge.ws_writer import FrameSink
from tidegate.wire import ws as wire
from tidegate.wire.streamlog import LogEvent


async def replay(sink: FrameSink, gen_id: str, reader: LogReader) -> None:
    """``accepted``, a ``chunk`` per event, then ``done``, ``cancelled`` or
    ``error`` (``reconnect`` when the edge drains). Backpressure is the
    socket's: ``sink.send`` waits for the client (and drops a client that
    does not drain); meanwhile the events wait in JetStream, not in the edge."""
    await sink.send([wire.accepted(gen_id, reader.request_id, resumable=True)])
    framer = wire.ChunkFramer(gen_id)
    while True:
        try:
            item = await reader.next_unless_draining(None)  # never None without a bound
        except StopAsyncIteration:
            return
        if isinstance(item, Draining):
            await sink.send([wire.reconnect(gen_id, reader.request_id, reader.last_id)])
            return
        assert item is not None
        if isinstance(item, LogEvent):
            framer.seq = item.id - 1  # the log's numbering is the seq
            frames = framer.frames(item.data)
            if frames:
                await sink.send(frames)
            continue
        if item.error is None:
            d = item.done
            await sink.send([wire.done(gen_id, d.prompt_tokens, d.completion_tokens,
                                       d.finish_reason) if d is not None
                             else wire.done(gen_id, 0, 0, "")])
        elif item.error.code in CANCEL_CODES:
            await sink.send([wire.cancelled(gen_id)])
        else:
            await sink.send([wire.error(from_info(item.error), gen_id)])
        return
