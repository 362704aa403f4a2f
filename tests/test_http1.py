"""Http1Pool and Response against real loopback sockets (no mocks): framing,
keep-alive, push mode. Broken servers and regressions: test_http1_faults.py.
Every async test runs on asyncio's loop and on uvloop (``tests.rawhttp``).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from asyncio import StreamReader, StreamWriter

import pytest

from tests.pipeline import wait_for
from tests.rawhttp import (
    BLOCK,
    CHUNKED,
    CHUNKED_BODY,
    CHUNKED_HEAD,
    OK,
    Handler,
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
from workers.backends.http1 import Http1Pool, ServerDisconnected

# --- requests and framing -----------------------------------------------------------------


def test_authority_and_base_path() -> None:
    for url, expected in {"http://h.test/v1/": ("h.test", 80, "h.test", "/v1"),
                          "https://h.test": ("h.test", 443, "h.test", ""),
                          "http://h.test:443/a/b": ("h.test", 443, "h.test:443", "/a/b"),
                          "http://[::1]:8000/v1": ("::1", 8000, "[::1]:8000", "/v1")}.items():
        pool = Http1Pool(url, connect_timeout=1.0)
        assert (pool.host, pool.port, pool.authority, pool.base_path) == expected
    for bad in ("ftp://h.test", "http:///path", "h.test:80"):
        with pytest.raises(ValueError, match="not an http"):
            Http1Pool(bad, connect_timeout=1.0)


@both_loops
async def test_request_reaches_the_server_exactly() -> None:
    async with served(answer(OK)) as (server, _):
        pool = Http1Pool(server.url + "/base/", connect_timeout=1.0)
        resp = await pool.request("POST", "/path", b"X-One: 1\r\nX-Two: two\r\n", b'{"a": 1}')
        assert (resp.status, await resp.read_all(10)) == (200, b"ok")
        pool.close()
    host = server.url.removeprefix("http://").encode()
    assert server.requests == [b"POST /base/path HTTP/1.1\r\nHost: " + host + b"\r\n"
                               b'Content-Length: 8\r\nX-One: 1\r\nX-Two: two\r\n\r\n{"a": 1}']


@both_loops
async def test_content_length_204_and_chunked_share_one_connection() -> None:
    no_content = b"HTTP/1.1 204 No Content\r\nX-A: 1\r\n\r\n"
    async with served(answer(OK, no_content, CHUNKED)) as (server, pool):
        for _ in range(2):
            resp = await get(pool, "/0")
            assert (resp.headers["content-length"], await resp.read_all(2)) == ("2", b"ok")
            resp = await get(pool, "/1")
            assert (resp.status, resp.ended, resp.headers) == (204, True, {"x-a": "1"})
            assert await resp.read_all(0) == b""
            resp = await get(pool, "/2")
            assert resp.status == 200  # the 100 Continue before it was skipped
            assert resp.headers["x-multi"] == "a, b"
            assert await resp.read_all(100) == CHUNKED_BODY
            assert pool.idle == 1
    assert (server.connections, len(server.requests)) == (1, 6)


@both_loops
async def test_chunked_body_split_at_every_byte_boundary() -> None:
    """Each request's response comes in two reads, cut one byte further along."""
    async def handle(server: Server, reader: StreamReader, writer: StreamWriter) -> None:
        while await server.read_request(reader):
            await write_in_pieces(writer, CHUNKED, (len(server.requests),))

    async with served(handle) as (server, pool):
        for _ in range(1, len(CHUNKED)):
            resp = await get(pool)
            assert (resp.status, await resp.read_all(100)) == (200, CHUNKED_BODY)
    assert (server.connections, len(server.requests)) == (1, len(CHUNKED) - 1)


@both_loops
async def test_chunked_body_one_byte_at_a_time() -> None:
    async with served(answer(CHUNKED, cuts=tuple(range(1, len(CHUNKED))))) as (server, pool):
        resp = await get(pool)
        sink = Sink()
        resp.start(sink.data, sink.end)
        assert await sink.ended is None
        assert sink.body == CHUNKED_BODY
        assert len(sink.chunks) > 10  # pushed as it came, not gathered
        assert await (await get(pool)).read_all(100) == CHUNKED_BODY
    assert server.connections == 1


@both_loops
async def test_responses_that_forbid_reuse() -> None:
    """A body delimited by the close, ``Connection: close`` and HTTP/1.0 each
    cost a connection: the client closes it even where the server would not."""
    responses = (b"HTTP/1.1 200 OK\r\n\r\nuntil the end",
                 b"HTTP/1.1 200 OK\r\nConnection: keep-alive, close\r\nContent-Length: 2\r\n\r\nok",
                 b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nok")

    async def handle(server: Server, reader: StreamReader, writer: StreamWriter) -> None:
        while request := await server.read_request(reader):
            writer.write(responses[int(request[5:6])])
            if request.startswith(b"GET /0 "):
                writer.write_eof()  # the body's end

    async with served(handle) as (server, pool):
        for i, body in enumerate((b"until the end", b"ok", b"ok")):
            assert await (await get(pool, f"/{i}")).read_all(100) == body
            assert pool.idle == 0
        assert await wait_for(lambda: server.eofs == 3, 15.0)
    assert server.connections == 3


# --- the keep-alive race ------------------------------------------------------------------


@both_loops
async def test_kept_alive_connection_closed_by_the_server_costs_no_request() -> None:
    """Connection 1 is closed right after its response; connection 2 reads its
    second request and closes unanswered: each request is retried, once."""
    async def handle(server: Server, reader: StreamReader, writer: StreamWriter) -> None:
        await server.read_request(reader)
        writer.write(OK)
        if server.connections <= 2:
            if server.connections == 2:
                await server.read_request(reader)
            writer.close()

    async with served(handle) as (server, pool):
        for _ in range(3):
            assert await (await get(pool)).read_all(2) == b"ok"
    assert (server.connections, len(server.requests)) == (3, 4)


@both_loops
async def test_connection_closed_before_an_answer_is_not_retried() -> None:
    """Not on a fresh connection, nor once any byte of the answer came."""
    async def handle(server: Server, reader: StreamReader, writer: StreamWriter) -> None:
        await server.read_request(reader)
        if server.connections == 1:
            writer.write(OK)
            await server.read_request(reader)
            writer.write(OK[:12])  # half a status line
        writer.close()

    async with served(handle) as (server, pool):
        assert await (await get(pool)).read_all(2) == b"ok"
        with pytest.raises(ServerDisconnected):
            await get(pool)
        assert server.connections == 1
        with pytest.raises(ServerDisconnected):
            await get(pool)
        assert server.connections == 2


# --- push mode ----------------------------------------------------------------------------


@both_loops
async def test_pause_stops_delivery_until_resume() -> None:
    blocks, sent = 1024, list[int]()  # 64 MiB: more than the socket buffers hold
    held = asyncio.Event()
    async with served(big_body(blocks, sent=sent, held=held)) as (_, pool):
        resp = await get(pool)
        sink, paused, late = Sink(), asyncio.Event(), []

        def on_data(data: bytes) -> None:
            if paused.is_set():
                late.append(data)
            sink.data(data)
            if not paused.is_set() and len(sink.chunks) == 3:
                resp.pause()
                paused.set()

        resp.start(on_data, sink.end)
        await paused.wait()
        # Paused, the client reads nothing more: TCP holds the server back.
        await asyncio.wait_for(held.wait(), 10)
        assert late == []
        assert sum(sent) < blocks * len(BLOCK)  # the server is held back too
        paused.clear()
        resp.resume()
        assert await sink.ended is None
        assert sink.body == BLOCK * blocks
        assert pool.idle == 1


@both_loops
async def test_server_dropping_mid_body_ends_with_an_error() -> None:
    async def handle(server: Server, reader: StreamReader, writer: StreamWriter) -> None:
        await server.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n0123456789")
        writer.close()

    async with served(handle) as (_, pool):
        resp = await get(pool)
        sink = Sink()
        resp.start(sink.data, sink.end)
        assert isinstance(await sink.ended, ServerDisconnected)
        assert (sink.body, pool.idle) == (b"0123456789", 0)


@both_loops
async def test_body_bytes_before_start_are_delivered_on_start() -> None:
    async def handle(server: Server, reader: StreamReader, writer: StreamWriter) -> None:
        await server.read_request(reader)
        writer.write(CHUNKED_HEAD + b"5\r\nearly\r\n")  # one read with the head
        await started.wait()  # "late" only after start(): it cannot come before
        writer.write(b"4\r\nlate\r\n0\r\n\r\n")
        while await server.read_request(reader):
            writer.write(OK)  # with its whole body, before start()

    started = asyncio.Event()
    async with served(handle) as (server, pool):
        resp = await get(pool)
        assert await wait_for(lambda: bool(resp._early), 5.0), "early came before start()"
        sink = Sink()
        resp.start(sink.data, sink.end)
        started.set()
        assert sink.chunks == [b"early"]  # in start() itself
        assert await sink.ended is None
        assert sink.body == b"earlylate"

        resp = await get(pool)
        # Its whole body arrived before start(): complete, so pooled already.
        assert await wait_for(lambda: pool.idle == 1, 5.0)
        sink = Sink()
        resp.start(sink.data, sink.end)
        assert (sink.chunks, sink.ended.done()) == ([b"ok"], True)
        assert await (await get(pool)).read_all(2) == b"ok"  # on that pooled connection
    assert server.connections == 1


def chunks_then_end(after: float) -> Handler:
    """A chunked body whose terminator comes ``after`` seconds late (or never,
    if the client closes first)."""
    async def handle(server: Server, reader: StreamReader, writer: StreamWriter) -> None:
        while await server.read_request(reader):
            writer.write(CHUNKED_HEAD + b"4\r\ndata\r\n")
            try:
                async with asyncio.timeout(after):
                    await server.read_request(reader)  # nothing comes but the client's close
                return
            except TimeoutError:
                writer.write(b"0\r\n\r\n")

    return handle


@both_loops
async def test_finish_pools_the_connection_if_the_body_ends_within_grace() -> None:
    async with served(chunks_then_end(0.1)) as (server, pool):
        resp = await get(pool)
        sink = Sink()
        resp.start(sink.data, sink.end)
        assert await wait_for(lambda: bool(sink.chunks), 15.0)
        resp.finish(0.5)
        assert pool.idle == 0
        assert await wait_for(lambda: pool.idle == 1, 15.0)
        assert not sink.ended.done()  # finish() dropped the consumer's callbacks
        assert await (await get(pool)).read_all(100) == b"data"
    assert (server.connections, server.eofs) == (1, 0)


@both_loops
async def test_finish_closes_the_connection_if_the_body_does_not_end_in_time() -> None:
    async with served(chunks_then_end(5.0)) as (server, pool):
        resp = await get(pool)
        sink = Sink()
        resp.start(sink.data, sink.end)
        assert await wait_for(lambda: bool(sink.chunks), 15.0)
        finished = time.monotonic()
        resp.finish(0.1)
        assert await wait_for(lambda: server.eofs == 1, 15.0)
        assert time.monotonic() - finished >= 0.1
        assert pool.idle == 0


@both_loops
async def test_abort_reaches_the_server_before_the_loop_iteration_ends() -> None:
    """A worker aborting many streams at once does all that in one loop
    iteration; the server must see the close at the abort, not after it."""
    listener = socket.create_server(("127.0.0.1", 0))
    closed_at: list[float] = []

    def serve() -> None:  # on a thread: the test blocks its own loop
        conn, _ = listener.accept()
        with conn:
            conn.recv(65536)
            conn.sendall(CHUNKED_HEAD + b"4\r\ndata\r\n")
            with contextlib.suppress(ConnectionError):
                while conn.recv(65536):
                    pass
            closed_at.append(time.monotonic())

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    pool = Http1Pool(f"http://127.0.0.1:{listener.getsockname()[1]}", connect_timeout=1.0)
    try:
        resp = await get(pool)
        got = asyncio.Event()
        resp.start(lambda data: got.set(), lambda exc: None)
        await got.wait()
        resp.abort()
        resp.abort()  # idempotent
        time.sleep(1.0)  # noqa: ASYNC251 - the rest of a busy iteration: nothing yields
        busy_end = time.monotonic()
        thread.join(2)
        assert closed_at, "the server never saw the close"
        # Causality: the server (a thread) saw the close while this loop was
        # still busy, i.e. at the abort, not when the loop ran again.
        assert closed_at[0] < busy_end, f"seen {closed_at[0] - busy_end:.3f}s after the iteration"
    finally:
        pool.close()
        listener.close()


@both_loops
async def test_read_all_limit() -> None:
    body = bytes(range(200)) * 5
    response = b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n" + body
    async with served(answer(response, cuts=(500, 800))) as (server, pool):
        assert await (await get(pool)).read_all(1000) == body  # exactly at the limit
        assert await (await get(pool)).read_all(650, truncate=True) == body[:650]
        assert pool.idle == 0
        with pytest.raises(http1.BodyTooLarge):
            await (await get(pool)).read_all(999)
        assert await wait_for(lambda: server.eofs == 2, 15.0)
    assert server.connections == 2  # the first two shared one


@both_loops
async def test_pool_close_ends_streams_and_refuses_requests() -> None:
    async with served(chunks_then_end(5.0)) as (server, pool):
        resp = await get(pool)
        sink = Sink()
        resp.start(sink.data, sink.end)
        assert await wait_for(lambda: bool(sink.chunks), 15.0)
        pool.close()
        assert isinstance(await sink.ended, ServerDisconnected)
        assert await wait_for(lambda: server.eofs == 1, 15.0)
        with pytest.raises(ConnectionError, match="closed"):
            await get(pool)


