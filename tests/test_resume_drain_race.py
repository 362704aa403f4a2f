"""The edge's drain against a resumed stream's next event (issue 26).

At drain, ``GET /v1/streams/{id}`` ends with ``event: reconnect`` naming the
last event the client got; the client resumes after it. The edge used to
stop its reader by cancelling the read in flight, and a cancel that met a
message already on the subscription (Python 3.11's ``wait_for`` then returns
the message instead of raising) let the reader hand out, and count, one more
event than was written: the reconnect said 6 where the client had 5, and a
client that follows the protocol lost event 6.

The test makes that moment certain instead of likely: the client stops
reading, so the edge's handler is stuck writing an event while the rest of
the log waits on its subscription; the edge drains; then the client reads.
Against real NATS (the log is a JetStream stream) and a real HTTP server.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web

from edge.logreader import StreamLog
from edge.resume import stream_events
from tests.poll import eventually
from tests.servers import ServerHandle
from tidegate.broker import broker
from tidegate.config import Config, NatsConfig
from tidegate.wire import streamlog
from tidegate.wire.protocol import Chunk, Head
from tidegate.wire.streamlog import LogOpen

TENANT = "acme"
REQUEST_ID = "ab" * 12
EVENTS = 64
EVENT = b"data: " + b"x" * 16_000 + b"\n\n"


@pytest.fixture
async def edge(nats_server: ServerHandle) -> AsyncIterator[dict[str, Any]]:
    """A stream log holding a long stream, and an HTTP server that serves
    ``GET /v1/streams/{id}`` from it as the edge does, with small socket
    buffers so that a client that stops reading blocks the handler soon."""
    config = Config(nats=NatsConfig(url=nats_server.url))
    nc = await broker.connect(config.nats, "test")
    js = broker.jetstream(nc, config.nats)
    await broker.ensure_streams(js, config)
    subject = streamlog.subject(config.nats.subjects, REQUEST_ID)
    await js.publish(subject, LogOpen(TENANT, True, 0, int(time.time() * 1000), 60.0).encode())
    await js.publish(subject, Head(1, "tg.test.control").encode())
    for seq in range(2, EVENTS + 2):
        await js.publish(subject, Chunk(seq, EVENT).encode())
    log = StreamLog(nc, js, config)
    seen: dict[str, Any] = {"log": log, "js": js, "stream": log.stream}

    async def handler(http: web.Request) -> web.StreamResponse:
        seen["http"] = http
        return await stream_events(http, log, config, TENANT)

    app = web.Application()
    app.router.add_get("/v1/streams/{request_id}", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)  # inherited on accept
    listener.bind(("127.0.0.1", 0))
    site = web.SockSite(runner, listener)
    await site.start()
    seen["port"] = listener.getsockname()[1]
    try:
        yield seen
    finally:
        await runner.cleanup()
        await nc.close()


async def test_reconnect_names_the_last_event_written_when_drain_meets_the_next(
        edge: dict[str, Any]) -> None:
    client = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    client.setblocking(False)
    await asyncio.get_running_loop().sock_connect(client, ("127.0.0.1", edge["port"]))
    reader, writer = await asyncio.open_connection(sock=client)
    writer.write(f"GET /v1/streams/{REQUEST_ID} HTTP/1.0\r\n\r\n".encode())
    # The client reads nothing yet. The handler blocks in a write (its
    # transport paused above high water) ...
    http = await eventually(lambda: edge.get("http"), 10, "the request reached the handler")

    def write_paused() -> bool:
        transport = http.transport
        return (transport is not None
                and transport.get_write_buffer_size() > transport.get_write_buffer_limits()[1])

    await eventually(write_paused, 30, "the handler blocked writing to a client that stopped "
                                       "reading")

    # ... while JetStream has pushed the rest of the log to the edge.
    async def all_delivered() -> bool:
        infos = await edge["js"].consumers_info(edge["stream"])
        return any(info.delivered.stream_seq >= EVENTS + 2 for info in infos)

    await eventually(all_delivered, 30, "the log was delivered to the edge's reader")
    edge["log"].drain()
    raw = await asyncio.wait_for(reader.read(), 60)  # the client reads on, to the end
    writer.close()

    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.0 200") or head.startswith(b"HTTP/1.1 200"), head[:200]
    ids: list[int] = []
    reconnect: dict[str, Any] | None = None
    for block in body.split(b"\n\n"):
        lines = block.split(b"\n")
        if b"event: reconnect" in lines:
            data = next(line for line in lines if line.startswith(b"data: "))
            reconnect = json.loads(data[len(b"data: "):])
        for line in lines:
            if line.startswith(b"id: "):
                ids.append(int(line[len(b"id: "):]))
    assert ids == list(range(1, len(ids) + 1))
    assert 0 < len(ids) < EVENTS, "the drain came mid-stream"
    assert reconnect is not None, body[-300:]
    # Resuming after it must give the very next event: no event is skipped.
    assert reconnect["last_event_id"] == ids[-1]
