"""A plain single-process streaming proxy: the baseline a gateway must beat.

One aiohttp server, one pooled aiohttp client. A request is forwarded
unchanged to the upstream; the response bytes are relayed as they arrive,
each write awaited (so a slow client pushes back on the upstream through TCP).
No broker, no auth, no parsing: the least work a Python proxy can do. When
the client disconnects, aiohttp cancels the handler and the upstream
connection is closed.

    python -m bench.baseline_proxy --port P --upstream http://127.0.0.1:8001/v1
"""

from __future__ import annotations

import argparse
import contextlib

import aiohttp
from aiohttp import web

from bench import run_async
from fleet.run.runtime import wait_for_signal

_SESSION = web.AppKey("session", aiohttp.ClientSession)
_UPSTREAM = web.AppKey("upstream", str)
_HOP_HEADERS = ("Content-Type", "Authorization")


async def _relay(request: web.Request) -> web.StreamResponse:
    session, upstream = request.app[_SESSION], request.app[_UPSTREAM]
    body = await request.read()
    headers = {h: request.headers[h] for h in _HOP_HEADERS if h in request.headers}
    async with session.post(f"{upstream}/{request.match_info['tail']}", data=body,
                            headers=headers) as up:
        try:
            resp = web.StreamResponse(status=up.status, headers={
                "Content-Type": up.headers.get("Content-Type", "application/octet-stream"),
                "Cache-Control": "no-cache"})
            await resp.prepare(request)
            async for data in up.content.iter_any():
                await resp.write(data)
            await resp.write_eof()
            return resp
        except BaseException:
            up.close()  # do not hand an unfinished upstream connection back to the pool
            raise


async def _healthz(_request: web.Request) -> web.Response:
    return web.Response(text="ok")


async def _serve(host: str, port: int, upstream: str) -> None:
    app = web.Application()
    app.router.add_get("/healthz", _healthz)
    app.router.add_post("/v1/{tail:.*}", _relay)
    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                    auto_decompress=False,
                                    timeout=aiohttp.ClientTimeout(total=None, sock_connect=10))
    app[_SESSION] = session
    app[_UPSTREAM] = upstream.rstrip("/")
    try:
        await serve_until_signal(app, host, port)
    finally:
        await session.close()


async def serve_until_signal(app: web.Application, host: str, port: int) -> None:
    """Serve ``app`` until SIGINT or SIGTERM, handlers cancelled with their
    client (the bench's relays' shared way to listen)."""
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port, backlog=4096).start()
    try:
        await wait_for_signal()
    finally:
        await runner.cleanup()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.baseline_proxy")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream", required=True, help="base URL ending in /v1")
    args = parser.parse_args(argv)
    with contextlib.suppress(KeyboardInterrupt):
        run_async(_serve(args.host, args.port, args.upstream))


if __name__ == "__main__":
    main()
