"""Raw loopback HTTP servers for the tests of ``workers.backends.http1``.

The servers are ``asyncio.start_server`` handlers that write exact bytes, so a
test controls the framing and where the client's reads split; ``both_loops``
runs a test on asyncio's own loop and on uvloop, which the worker runs on (its
transports are not ``asyncio.Transport`` subclasses).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from asyncio import StreamReader, StreamWriter
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any

import pytest
import uvloop

from workers.backends.http1 import Http1Pool, Response

OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
CHUNKED_HEAD = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
CHUNKED = (b"HTTP/1.1 100 Continue\r\n\r\n"
           b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nX-Multi: a\r\nX-Multi: b\r\n\r\n"
           b"5;x=y\r\nhello\r\n1a\r\nabcdefghijklmnopqrstuvwxyz\r\n"
           b"0;last=1\r\nX-Trailer: t\r\n\r\n")
CHUNKED_BODY = b"helloabcdefghijklmnopqrstuvwxyz"
BLOCK = bytes(range(256)) * 256  # 64 KiB of body
ROOT = Path(__file__).resolve().parents[1]

LoopFactory = Callable[[], asyncio.AbstractEventLoop]


def both_loops(test: Callable[[], Coroutine[Any, Any, None]]) -> Callable[[LoopFactory], None]:
    """Run the async ``test`` on a fresh asyncio loop and on a fresh uvloop, 10 s at most."""

    @pytest.mark.parametrize("loop_factory", [
        pytest.param(asyncio.new_event_loop, id="asyncio"),
        pytest.param(uvloop.new_event_loop, id="uvloop")])
    def run(loop_factory: LoopFactory) -> None:
        async def bounded() -> None:
            async with asyncio.timeout(10):
                await test()

        with asyncio.Runner(loop_factory=loop_factory) as runner:
            runner.run(bounded())

    run.__name__ = run.__qualname__ = test.__name__
    run.__doc__ = test.__doc__
    return run


# --- a raw server -------------------------------------------------------------------------


class Server:
    """What a raw loopback server saw: connections, requests, closes by the client."""

    def __init__(self) -> None:
        self.url = ""
        self.connections = 0
        self.requests: list[bytes] = []
        self.eofs = 0  # connections the client closed (read as EOF or reset)

    async def read_request(self, reader: StreamReader) -> bytes:
        """The next request on a connection; b"" once the client closed it."""
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            length = re.search(rb"(?i)\r\ncontent-length: *(\d+)", head)
            request = head + await reader.readexactly(int(length[1]) if length else 0)
        except (asyncio.IncompleteReadError, ConnectionError):
            return b""
        self.requests.append(request)
        return request


Handler = Callable[[Server, StreamReader, StreamWriter], Awaitable[None]]


@contextlib.asynccontextmanager
async def served(handler: Handler) -> AsyncIterator[tuple[Server, Http1Pool]]:
    """A loopback server running ``handler`` per connection, and a pool for it.
    A handler that returns without closing its end waits for the client's close."""
    server = Server()

    async def on_connect(reader: StreamReader, writer: StreamWriter) -> None:
        server.connections += 1
        try:
            await handler(server, reader, writer)
            if not writer.is_closing():
                while await server.read_request(reader):
                    pass
                server.eofs += 1
        except ConnectionError:
            pass
        finally:
            writer.close()

    listener = await asyncio.start_server(on_connect, "127.0.0.1", 0)
    server.url = f"http://127.0.0.1:{listener.sockets[0].getsockname()[1]}"
    pool = Http1Pool(server.url, connect_timeout=1.0)
    async with listener:
        try:
            yield server, pool
        finally:
            pool.close()


def answer(*responses: bytes, cuts: tuple[int, ...] = ()) -> Handler:
    """Answer a request for ``/i`` with ``responses[i]`` (``/`` is 0) until the
    client closes; each response is written in pieces cut at ``cuts``."""

    async def handle(server: Server, reader: StreamReader, writer: StreamWriter) -> None:
        while request := await server.read_request(reader):
            index = re.match(rb"\S+ /(\d+) ", request)
            await write_in_pieces(writer, responses[int(index[1]) if index else 0], cuts)

    return handle


async def write_in_pieces(writer: StreamWriter, data: bytes, cuts: tuple[int, ...]) -> None:
    """Write ``data`` cut at ``cuts``; the pause lets the client read each piece alone."""
    start = 0
    for cut in (*cuts, len(data)):
        writer.write(data[start:cut])
        await writer.drain()
        await asyncio.sleep(0.0005)
        start = cut


async def get(pool: Http1Pool, path: str = "/") -> Response:
    return await pool.request("GET", path, b"", b"")


class Sink:
    """Collects what :meth:`Response.start` pushes, checking the callbacks' contract."""

    def __init__(self) -> None:
        self.chunks: list[bytes] = []
        self.ended: asyncio.Future[BaseException | None] = (
            asyncio.get_running_loop().create_future())

    def data(self, data: bytes) -> None:
        assert data, "on_data got empty bytes"
        assert not self.ended.done(), "on_data after on_end"
        self.chunks.append(data)

    def end(self, exc: BaseException | None) -> None:
        assert not self.ended.done(), "on_end called twice"
        self.ended.set_result(exc)

    @property
    def body(self) -> bytes:
        return b"".join(self.chunks)


def big_body(blocks: int, first: bytes = b"", sent: list[int] | None = None,
             held: asyncio.Event | None = None, go: asyncio.Event | None = None) -> Handler:
    """Answer with ``first`` and, 50 ms later (or once ``go`` is set),
    ``blocks`` of BLOCK; ``sent`` counts what the server got out. ``held`` is
    set when TCP holds the server back (the kernel buffers are full and its
    write buffer passed the high-water mark): the client stopped reading."""
    async def handle(server: Server, reader: StreamReader, writer: StreamWriter) -> None:
        await server.read_request(reader)
        length = len(first) + blocks * len(BLOCK)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (length, first))
        if go is not None:
            await go.wait()
        else:
            await asyncio.sleep(0.05)
        high = writer.transport.get_write_buffer_limits()[1]
        for _ in range(blocks):
            writer.write(BLOCK)
            if held is not None and writer.transport.get_write_buffer_size() > high:
                held.set()
            await writer.drain()
            if sent is not None:
                sent.append(len(BLOCK))

    return handle
