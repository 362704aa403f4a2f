"""What the tests of real clients share (docs/clients.md): the client
library, imported or each test that uses it skipped (failed under
``CI=true``, so CI never passes with a client unrun); a recording proxy in
front of the edge, so a test sees what the client sent and what the edge
answered; and the text the simulator writes for a body, to check a client's
output against.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from tests.llama_server import missing
from tests.pipeline import serve_app
from tidegate.config import ModelConfig, SimulatorConfig
from tidegate.wire.protocol import Api, Request
from workers.backends.simulator import SimulatorBackend

# Not forwarded by the recording proxy: they describe one hop, not the request.
_HOP = frozenset({"host", "content-length", "transfer-encoding", "connection", "keep-alive",
                  "content-encoding", "accept-encoding"})


class MissingClient:
    """Stands for a client library that cannot be imported: the first test
    (or fixture) that touches it skips, or fails under ``CI=true``. Module
    import and collection never touch it, so one missing client fails its
    own tests, not the whole run."""

    def __init__(self, name: str, error: ImportError) -> None:
        self._name = name
        self._error = error

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("_"):  # what pytest's collection looks up
            raise AttributeError(attr)
        missing(f"the client library {self._name!r} cannot be imported ({self._error}): "
                "pip install -e '.[dev]' installs the pinned version")
        raise AssertionError("unreachable")


def client_module(name: str) -> Any:
    """``import name``, or a :class:`MissingClient` for it."""
    try:
        return importlib.import_module(name)
    except ImportError as error:
        return MissingClient(name, error)


@dataclass
class Exchange:
    """One request a client sent and the edge's answer."""

    method: str
    path: str  # with the query
    headers: dict[str, str]
    body: Any
    status: int = 0
    response_headers: dict[str, str] = field(default_factory=dict)
    response: bytes = b""

    def json(self) -> Any:
        return json.loads(self.response)


class Recorder:
    """A proxy in front of the edge that keeps every exchange, streaming the
    answer through as it comes (clients read events as they arrive)."""

    def __init__(self, upstream: str, timeout: float) -> None:
        self.upstream = upstream
        self.timeout = timeout
        self.exchanges: list[Exchange] = []

    async def handle(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        exchange = Exchange(request.method, str(request.rel_url), dict(request.headers),
                            json.loads(raw) if raw else None)
        self.exchanges.append(exchange)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        async with aiohttp.ClientSession(auto_decompress=True) as session, session.request(
                request.method, self.upstream + str(request.rel_url), headers=headers,
                data=raw, timeout=aiohttp.ClientTimeout(total=self.timeout)) as upstream:
            exchange.status = upstream.status
            exchange.response_headers = dict(upstream.headers)
            response = web.StreamResponse(status=upstream.status, headers={
                k: v for k, v in upstream.headers.items() if k.lower() not in _HOP})
            await response.prepare(request)
            body = bytearray()
            async for chunk in upstream.content.iter_any():
                body += chunk
                await response.write(chunk)
            exchange.response = bytes(body)
            await response.write_eof()
        return response

    def to(self, path: str) -> list[Exchange]:
        """The exchanges with ``path`` (the query aside), in order."""
        return [e for e in self.exchanges if e.path.split("?")[0] == path]

    def refused(self) -> list[tuple[str, int, bytes]]:
        return [(e.path, e.status, e.response[:300]) for e in self.exchanges if e.status != 200]


@asynccontextmanager
async def recording(upstream: str,
                    upstream_timeout: float = 120.0) -> AsyncIterator[tuple[Recorder, str]]:
    """A :class:`Recorder` in front of ``upstream`` (an edge's root URL), and its URL."""
    proxy = Recorder(upstream, upstream_timeout)
    app = web.Application(client_max_size=64 << 20)
    app.router.add_route("*", "/{tail:.*}", proxy.handle)
    async with serve_app(app) as url:
        yield proxy, url


async def simulator_text(api: Api, body: dict[str, Any], sim: SimulatorConfig) -> str:
    """The text the simulator (configured as ``sim``) writes for ``body``: a
    chat, Responses or Messages request, answered whole."""
    backend = SimulatorBackend(ModelConfig(name="tidegate-sim", simulator=sim))
    request = Request(id="x", reply="r", model="tidegate-sim", api=api, stream=False,
                      body={**body, "stream": False}, created_ms=0, deadline_ms=0,
                      window_bytes=1, window_msgs=1)
    stream = await backend.open(request)
    raw = b""
    while data := await stream.read(1 << 20):
        raw += data
    answer = json.loads(raw)
    if api == Api.CHAT:
        return str(answer["choices"][0]["message"]["content"])
    if api == Api.RESPONSES:
        return "".join(part["text"] for item in answer["output"] if item["type"] == "message"
                       for part in item["content"] if part["type"] == "output_text")
    return "".join(b["text"] for b in answer["content"] if b["type"] == "text")
