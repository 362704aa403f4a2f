"""edge.raw_http against the installed aiohttp: a real server prepares real
responses, and the two readers of aiohttp's private writer state answer as
the relay's fast path needs. An aiohttp upgrade that renames what they read
fails here (in the edge it would only turn the fast path off)."""

from __future__ import annotations

from typing import Any

from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from edge.raw_http import payload_writer, takes_raw_chunks


async def test_raw_chunks_only_where_aiohttp_would_send_plain_chunked_frames() -> None:
    seen: dict[str, Any] = {}

    async def chunked(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        seen["before"] = (payload_writer(response), takes_raw_chunks(response))
        await response.prepare(request)
        writer = payload_writer(response)
        seen["chunked"] = (writer is not None, takes_raw_chunks(response))
        assert writer is not None
        assert request.transport is not None
        n = len(b"raw")
        request.transport.write(b"%x\r\n%b\r\n" % (n, b"raw"))  # what the relay writes
        await response.write(b"+aiohttp")
        await writer.drain()
        await response.write_eof()
        return response

    async def compressed(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        response.enable_compression()
        await response.prepare(request)
        seen["compressed"] = takes_raw_chunks(response)
        await response.write_eof(b"x")
        return response

    async def sized(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        response.content_length = 1
        await response.prepare(request)
        seen["sized"] = takes_raw_chunks(response)
        await response.write_eof(b"x")
        return response

    app = web.Application()
    app.router.add_get("/chunked", chunked)
    app.router.add_get("/compressed", compressed)
    app.router.add_get("/sized", sized)
    async with TestClient(TestServer(app)) as client:
        resp = await client.get("/chunked")
        assert await resp.read() == b"raw+aiohttp", "a raw frame and aiohttp's own, in order"
        for path in ("/compressed", "/sized"):
            resp = await client.get(path, headers={"Accept-Encoding": "gzip"})
            assert resp.status == 200
    assert seen["before"] == (None, False), "not prepared: no writer yet"
    assert seen["chunked"] == (True, True)
    assert seen["compressed"] is False
    assert seen["sized"] is False
