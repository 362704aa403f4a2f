"""Http1Pool against broken servers, and regressions that once hung or misread
a connection. Every async test runs on asyncio's loop and on uvloop.
"""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import time
from asyncio import StreamReader, StreamWriter

import pytest

from tests.pipeline import wait_for
from tests.rawhttp import (
    CHUNKED,
    CHUNKED_BODY,
    CHUNKED_HEAD,
    OK,
    ROOT,
    Server,
    Sink,
    answer,
    big_body,
    both_loops,
    get,
    served,
    write_in_pieces,
)
from workers.backends import http1
from workers.backends.http1 import Http1Pool, ProtocolViolation

# --- broken servers -----------------------------------------------------------------------


BAD_HEADS = (b"HTPT/1.1 200 OK\r\n\r\n", b"HTTP/1.1 2OO OK\r\n\r\n", b"HTTP/2 200\r\n\r\n",
             b"<html>garbage</html>\r\n\r\n", b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n",
             b"HTTP/1.1 200 OK\r\nContent-Length: 12a\r\n\r\n",
             b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 2\r\n\r\nok",
             b"HTTP/1.1 200 OK\r\n" + b"X-Pad: %s\r\n" % (b"p" * 1000) * 70)  # 70 KiB, no end
BAD_CHUNKS = (b"zz\r\nhello\r\n0\r\n\r\n", b"5\r\nhelloXX0\r\n\r\n", b"5" * 1100)


@both_loops
async def test_protocol_violations() -> None:
    bad_bodies = tuple(CHUNKED_HEAD + chunks for chunks in BAD_CHUNKS)
    async with served(answer(*BAD_HEADS, *bad_bodies)) as (server, pool):
        for i in range(len(BAD_HEADS)):
            with pytest.raises(ProtocolViolation):
                await get(pool, f"/{i}")
        for i in range(len(BAD_HEADS), len(BAD_HEADS) + len(BAD_CHUNKS)):
            resp = await get(pool, f"/{i}")
            with pytest.raises(ProtocolViolation):
                await resp.read_all(100)
        assert pool.idle == 0
        assert await wait_for(lambda: server.eofs == server.connections, 10.0)
    assert server.connections == len(BAD_HEADS) + len(BAD_CHUNKS)
    assert issubclass(ProtocolViolation, ConnectionError)


@both_loops
async def test_bytes_after_the_end_of_a_response_close_the_connection() -> None:
    junk = b"HTTP/1.1 200 OK\r\n"

    async def handle(server: Server, reader: StreamReader, writer: StreamWriter) -> None:
        await server.read_request(reader)
        if server.connections == 1:
            writer.write(CHUNKED + junk)  # in the response's last read
            return
        for piece in (OK[:-2], OK[-2:], junk):  # after it, in a read of its own
            writer.write(piece)
            await asyncio.sleep(0.05)

    async with served(handle) as (server, pool):
        assert await (await get(pool)).read_all(100) == CHUNKED_BODY
        assert await wait_for(lambda: server.eofs == 1, 10.0)
        assert pool.idle == 0
        assert await (await get(pool)).read_all(2) == b"ok"
        assert pool.idle == 1
        assert await wait_for(lambda: server.eofs == 2, 10.0)
        assert pool.idle == 0


@both_loops
async def test_connect_errors() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(ConnectionRefusedError):
        await get(Http1Pool(f"http://127.0.0.1:{port}", connect_timeout=1.0))
    # A listener with a full accept queue drops further SYNs: connect hangs.
    with socket.create_server(("127.0.0.1", 0), backlog=0) as listener:
        port = listener.getsockname()[1]
        fillers = [socket.socket() for _ in range(3)]
        for filler in fillers:
            filler.setblocking(False)
            filler.connect_ex(("127.0.0.1", port))
        start = time.monotonic()
        try:
            with pytest.raises(http1.ConnectTimeout, match=r"within 0\.2s"):
                await get(Http1Pool(f"http://127.0.0.1:{port}", connect_timeout=0.2))
        finally:
            for filler in fillers:
                filler.close()
        # Not before its time. No upper bound: the ConnectTimeout naming 0.2 s
        # is the proof it fired (without it, connect hangs for the kernel's
        # minutes of SYN retries), and a busy machine may wake it late.
        assert time.monotonic() - start > 0.15


# --- regressions: each of these once hung or misread a connection --------------------


@both_loops
async def test_pause_from_on_data_during_start_holds() -> None:
    held, go = asyncio.Event(), asyncio.Event()
    async with served(big_body(1024, first=b"early", held=held, go=go)) as (_, pool):
        resp = await get(pool)
        # "early" came before start() (with the head); the rest only after it.
        assert await wait_for(lambda: bool(resp._early), 5.0)
        calls = []

        def on_data(data: bytes) -> None:
            calls.append(len(data))
            resp.pause()  # a consumer without credit

        resp.start(on_data, lambda exc: None)
        go.set()
        await asyncio.wait_for(held.wait(), 10)  # paused: TCP holds the server back
        assert calls == [len(b"early")]


@both_loops
async def test_stray_bytes_on_an_idle_connection_never_answer_the_next_request() -> None:
    answered, stale_sent = asyncio.Event(), asyncio.Event()

    async def handle(server: Server, reader: StreamReader, writer: StreamWriter) -> None:
        await server.read_request(reader)
        if server.connections == 1:
            writer.write(OK)  # head and body in one read, before start()
            await answered.wait()  # the client has its answer: the connection is idle
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nstale")  # unasked
            await writer.drain()
            stale_sent.set()
            await server.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nfresh")

    async with served(handle) as (_, pool):
        assert await (await get(pool)).read_all(2) == b"ok"
        assert pool.idle == 1
        answered.set()
        await stale_sent.wait()
        # The idle connection reads the stray bytes and closes itself.
        assert await wait_for(lambda: pool.idle == 0, 5.0), "stray bytes left it pooled"
        assert await (await get(pool)).read_all(5) == b"fresh"


@both_loops
async def test_pausing_a_finished_response_leaves_the_next_one_alone() -> None:
    async def handle(server: Server, reader: StreamReader, writer: StreamWriter) -> None:
        while await server.read_request(reader):
            await write_in_pieces(writer, OK, (len(OK) - 2,))

    async with served(handle) as (_, pool):
        first = await get(pool)
        assert await first.read_all(2) == b"ok"
        second = await get(pool)  # on the same connection
        first.pause()
        # A bound only so a wrongly paused second response fails, not hangs:
        # paused, it never completes, so a loaded box's late wake-up is no risk.
        assert await asyncio.wait_for(second.read_all(2), 10) == b"ok"


@both_loops
async def test_close_delimited_body_cut_by_pool_close_ends_with_an_error() -> None:
    async def handle(server: Server, reader: StreamReader, writer: StreamWriter) -> None:
        await server.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\n\r\nthe first part")

    async with served(handle) as (_, pool):
        resp = await get(pool)
        sink = Sink()
        resp.start(sink.data, sink.end)
        assert await wait_for(lambda: bool(sink.chunks), 10.0)
        pool.close()
        assert isinstance(await sink.ended, ConnectionError)


@both_loops
async def test_head_over_64_kib_ending_in_the_read_that_crosses_the_limit() -> None:
    start = b"HTTP/1.1 200 OK\r\n" + b"X-Pad: %s\r\n" % (b"p" * 990) * 65
    end = b"X-Tail: %s\r\nContent-Length: 2\r\n\r\nok" % (b"t" * 1000)
    assert len(start) < http1.MAX_HEAD < len(start + end)

    async def handle(server: Server, reader: StreamReader, writer: StreamWriter) -> None:
        await server.read_request(reader)
        writer.write(start)
        await asyncio.sleep(0.05)  # the client has read all of it
        writer.write(end)

    async with served(handle) as (_, pool):
        with pytest.raises(ProtocolViolation):
            await get(pool)


async def read_negative_chunk_size() -> None:
    """Run in a child process by the test below: what it shows is an endless loop."""
    response = CHUNKED_HEAD + b"1\r\na\r\n-6\r\nhello!\r\n0\r\n\r\n"  # in one read
    async with served(answer(response)) as (_, pool):
        resp = await get(pool)
        with pytest.raises(ProtocolViolation):
            await resp.read_all(100)


def test_negative_chunk_size_is_a_violation_not_a_hang() -> None:
    code = "import asyncio, tests.test_http1_faults as t; asyncio.run(t.read_negative_chunk_size())"
    # The spin never returns, so any bound shows it; 60 s, not a few, because
    # the child's interpreter start and imports alone take seconds on a busy box.
    try:
        child = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                               timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("the client spun in data_received and never returned")
    assert child.returncode == 0, child.stderr.decode()
