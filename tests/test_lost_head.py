"""A response lost whole on the way to its edge is asked for again.

A NATS node's death cuts the edges connected to it; they reconnect to
another node in about 0.5 s. A short response sent entirely in that window
(Head to Done) leaves the edge nothing to notice: before this was handled,
the request sat admitted until ``edge.queue_timeout`` (the chaos run's
streams with no end). Here the edge's link goes through a proxy that drops
everything the server sends, and answers the edge's PINGs itself so the
edge does not notice, while the worker runs the whole job; then the proxy
cuts the connection and the edge reconnects. The edge must ask every worker
for the response (``Subjects.retransmit_any``) and get it from the worker's
kept tail (``workers.tails``), byte-exact.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from pathlib import Path
from urllib.parse import urlsplit

import aiohttp
import pytest

from tests.pipeline import Pipeline, jobs_waiting, stream, usage_records
from tests.poll import eventually
from tests.servers import ServerHandle

pytestmark = pytest.mark.pipeline


class HoldingProxy:
    """TCP between a NATS client and its server. While held, whatever the
    server sends is dropped (counted in ``dropped``), and the client's PINGs
    are answered here, so the connection looks alive; :meth:`cut` closes
    every connection and lets the next ones through as they are."""

    def __init__(self, upstream: str) -> None:
        parts = urlsplit(upstream)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 4222
        self.holding = False
        self.dropped = 0
        self._server: asyncio.Server | None = None
        self._open: list[asyncio.StreamWriter] = []

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        return f"nats://127.0.0.1:{port}"

    async def _serve(self, client_r: asyncio.StreamReader,
                     client_w: asyncio.StreamWriter) -> None:
        server_r, server_w = await asyncio.open_connection(self.host, self.port)
        self._open += [client_w, server_w]

        async def down() -> None:  # server -> client
            while data := await server_r.read(1 << 16):
                if self.holding:
                    self.dropped += len(data)
                    continue
                client_w.write(data)
                await client_w.drain()

        async def up() -> None:  # client -> server
            while data := await client_r.read(1 << 16):
                if self.holding and b"PING\r\n" in data:
                    client_w.write(b"PONG\r\n" * data.count(b"PING\r\n"))
                server_w.write(data)
                await server_w.drain()

        with contextlib.suppress(ConnectionError, OSError):
            await asyncio.gather(down(), up())
        for w in (client_w, server_w):
            w.close()

    def cut(self) -> None:
        self.holding = False
        for w in self._open:
            w.close()
        self._open.clear()

    def close(self) -> None:
        self.cut()
        if self._server is not None:
            self._server.close()


async def test_a_response_sent_whole_while_the_edge_reconnects_is_asked_for_again(
        nats_server: ServerHandle, redis_server: ServerHandle, tmp_path: Path) -> None:
    proxy = HoldingProxy(nats_server.url)
    proxied = await proxy.start()
    pipeline = Pipeline(tmp_path, nats_server.url, redis_server.url,
                        edge_env={"TIDEGATE__NATS__URL": proxied})
    try:
        await asyncio.to_thread(pipeline.start)
        model = pipeline.config.models[0].name
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
            # The reference: the same prompt through a healthy link.
            expected, _ = await stream(session, pipeline.url, model, "whole")
            done_before = len(await usage_records(pipeline.config))
            # No worker while the request is admitted: the job waits in its
            # queue, and the edge has its dispatcher's answer, nothing more.
            await asyncio.to_thread(pipeline.workers[0].stop)
            reply = asyncio.create_task(stream(session, pipeline.url, model, "whole"))
            await eventually(lambda: jobs_waiting(pipeline, 1), 60, "the request admitted")
            proxy.holding = True
            pipeline.workers[0].spawn()
            # The worker runs the job to its end; nothing of it reaches the edge.
            await eventually(lambda: _usage_count(pipeline, done_before + 1), 120,
                             "the worker finished the job")
            assert proxy.dropped > 0, "the response went through the held link"
            assert not reply.done(), "the edge answered without the response"
            proxy.cut()
            got, _ = await asyncio.wait_for(reply, 250)
    finally:
        proxy.close()
        await asyncio.to_thread(pipeline.stop)
    assert _text(got) == _text(expected) != "", got[-400:]
    assert got.rstrip().endswith(b"data: [DONE]"), got[-400:]


async def _usage_count(pipeline: Pipeline, count: int) -> bool:
    return len(await usage_records(pipeline.config)) >= count


def _text(raw: bytes) -> str:
    """The content the stream's chunks carry, joined."""
    out = []
    for line in raw.split(b"\n"):
        if line.startswith(b"data: {"):
            for choice in json.loads(line[6:]).get("choices", []):
                out.append((choice.get("delta") or {}).get("content") or "")
    return "".join(out)
