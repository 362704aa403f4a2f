"""The seed articles' streaming proxy: FastAPI + httpx, as a bench peer.

Their pattern as written: one shared ``httpx.AsyncClient`` (1000 connections,
200 kept alive), ``client.stream()`` relayed by ``aiter_raw()`` through a
``StreamingResponse``, ``request.is_disconnected()`` checked before each chunk.
Departures: no ``http2=True`` (the fake speaks cleartext HTTP/1.1), completions
and non-streaming bodies relayed too, one uvicorn process. Needs the ``peers``
extra::

    python -m bench.fastapi_proxy --port P --upstream http://127.0.0.1:8001/v1
"""

from __future__ import annotations

import argparse
import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import PlainTextResponse, Response, StreamingResponse

log = logging.getLogger("bench.fastapi_proxy")

UPSTREAM_TIMEOUT = httpx.Timeout(connect=5.0, read=60.0, write=5.0, pool=10.0)
UPSTREAM_LIMITS = httpx.Limits(max_connections=1000, max_keepalive_connections=200)


def create_app(upstream: str) -> FastAPI:
    """The proxy in front of ``upstream`` (a base URL ending in ``/v1``)."""
    state: dict[str, httpx.AsyncClient] = {}

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        # One shared client for every request: never one per request.
        state["client"] = httpx.AsyncClient(base_url=upstream.rstrip("/"),
                                            timeout=UPSTREAM_TIMEOUT, limits=UPSTREAM_LIMITS)
        try:
            yield
        finally:
            await state["client"].aclose()

    app = FastAPI(title="LLM Stream Gateway (seed pattern)", lifespan=lifespan)

    async def forward_stream(request: Request, path: str,
                             payload: dict[str, Any]) -> AsyncGenerator[bytes, None]:
        headers = {"Content-Type": "application/json",
                   "Authorization": request.headers.get("Authorization", "")}
        try:
            async with state["client"].stream("POST", path, json=payload,
                                              headers=headers) as upstream_response:
                if upstream_response.status_code != 200:
                    error_body = await upstream_response.aread()
                    log.error("upstream error [%d]: %r", upstream_response.status_code,
                              error_body[:200])
                    yield b'data: {"error": "Upstream inference failed"}\n\n'
                    return
                async for chunk in upstream_response.aiter_raw():
                    # The client left: leaving the context closes the upstream
                    # connection, which makes the backend abort the generation.
                    if await request.is_disconnected():
                        log.warning("downstream client disconnected, closing upstream")
                        break
                    if chunk:
                        yield chunk
        except httpx.ReadTimeout:
            yield b'data: {"error": "Gateway read timeout from model engine"}\n\n'

    async def relay(request: Request, path: str) -> Response:
        try:
            payload = await request.json()
        except ValueError:
            raise HTTPException(status_code=400, detail="Invalid JSON body") from None
        if not isinstance(payload, dict):
            raise HTTPException(status_code=400, detail="Invalid JSON body")
        if not payload.get("stream", False):
            up = await state["client"].post(path, json=payload, headers={
                "Authorization": request.headers.get("Authorization", "")})
            return Response(up.content, status_code=up.status_code,
                            media_type=up.headers.get("content-type", "application/json"))
        return StreamingResponse(forward_stream(request, path, payload),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache, no-transform",
                                          "X-Accel-Buffering": "no"})

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await relay(request, "/chat/completions")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await relay(request, "/completions")

    @app.get("/healthz")
    async def healthz() -> Response:
        return PlainTextResponse("ok")

    return app


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.fastapi_proxy")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream", required=True, help="base URL ending in /v1")
    args = parser.parse_args(argv)
    uvicorn.run(create_app(args.upstream), host=args.host, port=args.port,
                log_level="warning", access_log=False, backlog=4096)


if __name__ == "__main__":
    main()
