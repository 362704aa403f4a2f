"""Connection-level defences (edge.guard) on a real socket, with aiohttp serving.

The app here is a stand-in with one echo route; what is under test is the
server around it: header deadline, connection caps, malformed HTTP answered in
OpenAI form, and that a normal request still works afterwards.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web

from edge.guard import GuardedSite
from fleet.run.servers import free_port
from tidegate.config import EdgeConfig

pytestmark = pytest.mark.asyncio


async def _echo(request: web.Request) -> web.Response:
    body = await request.read()
    return web.json_response({"len": len(body)})


class Served:
    def __init__(self, port: int, site: GuardedSite) -> None:
        self.port = port
        self.site = site

    async def open(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        return await asyncio.open_connection("127.0.0.1", self.port)

    async def exchange(self, raw: bytes, wait: float = 10.0) -> tuple[int, dict[str, Any]]:
        reader, writer = await self.open()
        try:
            writer.write(raw)
            await writer.drain()
            data = await asyncio.wait_for(reader.read(), wait)
        finally:
            writer.close()
        return parse(data)


def parse(data: bytes) -> tuple[int, dict[str, Any]]:
    head, _, body = data.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    return status, json.loads(body) if body else {}


async def serve(**edge: Any) -> AsyncIterator[Served]:
    app = web.Application()
    app.router.add_post("/echo", _echo)
    app.router.add_get("/echo", _echo)
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    config = EdgeConfig(host="127.0.0.1", port=free_port(), **edge)
    site = GuardedSite(runner, config)
    await site.start()
    try:
        yield Served(config.port, site)
    finally:
        await runner.cleanup()


GET = b"GET /echo HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"


async def test_slowloris_connections_are_cut_at_the_header_deadline() -> None:
    async for served in serve(header_timeout=0.5):
        conns = [await served.open() for _ in range(50)]
        for _, writer in conns:
            writer.write(b"GET /echo HTTP/1.1\r\nHost: x\r\n")  # never the blank line
        started = time.monotonic()
        answers = await asyncio.gather(*(asyncio.wait_for(r.read(), 10) for r, _ in conns))
        elapsed = time.monotonic() - started
        for data in answers:
            status, body = parse(data)
            assert status == 408
            assert body["error"]["code"] == "request_timeout"
        assert elapsed < 8  # cut near 0.5 s, not left open
        assert served.site.limits.total == 0
        # A request that completes its headers in time is served normally.
        assert (await served.exchange(GET))[0] == 200


async def test_headers_in_many_small_pieces_within_the_deadline_pass() -> None:
    async for served in serve(header_timeout=5.0):
        reader, writer = await served.open()
        for i in range(0, len(GET), 3):  # the blank line split across writes
            writer.write(GET[i:i + 3])
            await writer.drain()
            await asyncio.sleep(0.005)
        status, body = parse(await asyncio.wait_for(reader.read(), 10))
        writer.close()
        assert status == 200
        assert body == {"len": 0}


async def test_per_ip_cap_answers_a_clean_503() -> None:
    async for served in serve(max_connections_per_ip=5):
        held = [await served.open() for _ in range(5)]
        status, body = await served.exchange(GET)
        assert status == 503
        assert body["error"]["code"] == "too_many_connections"
        assert "address" in body["error"]["message"]
        for _, writer in held:
            writer.close()
        # Once they are gone, a new connection is admitted again.
        for _ in range(100):
            if served.site.limits.total == 0:
                break
            await asyncio.sleep(0.02)
        assert (await served.exchange(GET))[0] == 200


async def test_edge_cap_answers_a_503_with_retry_after() -> None:
    async for served in serve(max_connections=3, max_connections_per_ip=0):
        held = [await served.open() for _ in range(3)]
        reader, writer = await served.open()
        data = await asyncio.wait_for(reader.read(), 10)
        writer.close()
        assert b"Retry-After: 1" in data
        assert parse(data)[0] == 503
        for _, w in held:
            w.close()


@pytest.mark.parametrize("raw", [
    b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",  # request line too long
    b"GET /echo HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 9000 + b"\r\n\r\n",
    b"GET /echo HTTP/1.1\r\n" + b"".join(b"X-%d: 1\r\n" % i for i in range(150)) + b"\r\n",
    b"G\x00T /echo HTTP/1.1\r\nHost: x\r\n\r\n",
    b"GET /echo HTTP/1.1\r\nHost: x\r\nX-A: a\rb\r\n\r\n",
    b"GET /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\nhello",
    b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
    b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\r\n\r\n",  # TLS hello on a plain port
])
async def test_malformed_http_gets_an_openai_400(raw: bytes) -> None:
    async for served in serve():
        status, body = await served.exchange(raw)
        assert 400 <= status < 500
        assert set(body["error"]) >= {"message", "type", "code"}
        assert (await served.exchange(GET))[0] == 200
