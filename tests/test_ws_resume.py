"""WebSocket resume against real servers: a resumable generation started on
one edge's socket is resumed with a ``resume`` frame on another edge's
socket, losing and repeating nothing; another tenant gets 404; a resumed
stream can be cancelled; a draining edge says ``reconnect`` and the stream
goes on (docs/websocket.md, docs/resume.md)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import websockets
from websockets.asyncio.client import ClientConnection
from websockets.asyncio.client import connect as ws_connect

from bench.fake_backend import FakeBackend
from tests.pipeline import DEV_KEY, Pipeline, record_for, threaded_fake_backend, wait_for

pytestmark = pytest.mark.pipeline


@pytest.fixture(scope="module")
def backend() -> Iterator[FakeBackend]:
    with threaded_fake_backend(models=["fake"], ttft=0.01, itl=0.01, tokens=10**9,
                                keep_output=True) as fake:
        yield fake


def _pipeline(workdir: Path, nats_url: str, redis_url: str, backend: FakeBackend) -> Pipeline:
    return Pipeline(workdir, nats_url, redis_url, edges=2, overrides={
        "nats": {"subject_prefix": "w" + uuid.uuid4().hex[:8]},
        "session": {"heartbeat_interval": 1.0, "worker_lost_after": 4, "ack_timeout": 6.0},
        "worker": {"ack_wait": 2.0, "shutdown_timeout": 3.0},
        "edge": {"shutdown_timeout": 4.0, "slow_client_timeout": 4.0},
        "resume": {"attach_interval": 0.5},
        # Fast liveness, for the eviction test (the websockets client answers pings).
        "ws": {"idle_before_ping": 0.4, "ping_interval": 0.3, "pong_timeout": 0.3,
               "max_missed_pongs": 2},
        "models": [{"name": "fake", "backend": "openai", "base_url": backend.base_url,
                    "max_streams": 64}]})


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory: pytest.TempPathFactory, module_nats_url: str,
             module_redis_url: str, backend: FakeBackend) -> Iterator[Pipeline]:
    p = _pipeline(tmp_path_factory.mktemp("wsresume"), module_nats_url, module_redis_url,
                  backend)
    try:
        p.start()
        yield p
    finally:
        p.stop()


def url(p: Pipeline, edge: int) -> str:
    return f"ws://127.0.0.1:{p.edge_ports[edge]}/v1/ws"


def connect(p: Pipeline, edge: int = 0, key: str = DEV_KEY) -> Any:
    return ws_connect(url(p, edge), additional_headers={"Authorization": f"Bearer {key}"},
                      max_size=None)


def request(gid: str, marker: str, tokens: int, body: dict[str, Any] | None = None,
            **extra: Any) -> str:
    return json.dumps({"type": "request", "id": gid, "path": "/v1/chat/completions",
                       "resumable": True, **extra,
                       "body": {"model": "fake", "max_tokens": tokens,
                                "stream_options": {"include_usage": True},
                                "messages": [{"role": "user", "content": marker}],
                                **(body or {})}})


async def recv(ws: ClientConnection, within: float = 20.0) -> dict[str, Any]:
    frame: dict[str, Any] = json.loads(await asyncio.wait_for(ws.recv(), within))
    return frame


async def until_end(ws: ClientConnection, gid: str) -> list[dict[str, Any]]:
    frames: list[dict[str, Any]] = []
    while True:
        frame = await recv(ws)
        if frame.get("id") != gid:
            continue
        frames.append(frame)
        if frame["type"] in ("done", "error", "cancelled", "reconnect"):
            return frames


def chunk_data(frames: list[dict[str, Any]]) -> list[tuple[int, str]]:
    return [(f["seq"], json.dumps(f["data"], sort_keys=True)) for f in frames
            if f["type"] == "chunk"]


async def tenant_key(pipeline: Pipeline, tenant: str) -> str:
    created = await asyncio.to_thread(
        subprocess.run, [sys.executable, "-m", "fleet", "keys", "create", "--tenant", tenant,
                         "--json", "--config", str(pipeline.config_path)],
        capture_output=True, text=True, check=True)
    key = str(json.loads(created.stdout)["key"])
    async with aiohttp.ClientSession() as session:
        for edge_url in pipeline.edge_urls:
            deadline = time.monotonic() + 10
            while (await session.get(f"{edge_url}/v1/models",
                                     headers={"Authorization": f"Bearer {key}"})).status != 200:
                assert time.monotonic() < deadline, "the new key never reached the edge"
                await asyncio.sleep(0.05)
    return key


async def test_resume_on_another_edge_loses_and_repeats_nothing(pipeline: Pipeline) -> None:
    marker = f"wsresume-{uuid.uuid4().hex}"
    first: list[dict[str, Any]] = []
    async with connect(pipeline, 0) as ws:
        await ws.send(request("g", marker, 300))
        while sum(f["type"] == "chunk" for f in first) < 20:
            frame = await recv(ws)
            first.append(frame)
        # The connection breaks mid-stream (no close handshake).
        ws.transport.abort()
    accepted = first[0]
    assert accepted["type"] == "accepted"
    assert accepted["resumable"] is True
    rid = accepted["request_id"]
    last = [f for f in first if f["type"] == "chunk"][-1]["seq"]

    async with connect(pipeline, 1) as ws:
        await ws.send(json.dumps({"type": "resume", "id": "again", "request_id": rid,
                                  "after": last}))
        second = await until_end(ws, "again")
    assert second[0] == {"type": "accepted", "id": "again", "request_id": rid,
                         "resumable": True}
    assert second[-1]["type"] == "done"
    assert second[-1]["usage"]["completion_tokens"] == 300
    got = chunk_data(first) + chunk_data(second)
    assert [seq for seq, _ in got] == list(range(1, len(got) + 1))  # none lost, none twice

    # The whole stream, replayed from 0 on a third socket, is what the two got.
    async with connect(pipeline, 0) as ws:
        await ws.send(json.dumps({"type": "resume", "id": "all", "request_id": rid,
                                  "after": 0}))
        full = await until_end(ws, "all")
    assert chunk_data(full) == got
    assert full[-1]["type"] == "done"


async def test_other_tenant_gets_stream_not_found(pipeline: Pipeline) -> None:
    other = await tenant_key(pipeline, "other-ws")
    marker = f"wstenant-{uuid.uuid4().hex}"
    async with connect(pipeline, 0) as ws:
        await ws.send(request("g", marker, 5))
        frames = await until_end(ws, "g")
    rid = frames[0]["request_id"]
    assert frames[-1]["type"] == "done"
    async with connect(pipeline, 1, key=other) as ws:
        for request_id in (rid, "0" * 24, "not-an-id"):
            await ws.send(json.dumps({"type": "resume", "id": "x", "request_id": request_id,
                                      "after": 0}))
            answer = await recv(ws)
            assert answer["type"] == "error"
            assert answer["id"] == "x"
            assert answer["error"]["code"] == "stream_not_found"
        # The socket goes on; and the owner may still resume.
        await ws.send(json.dumps({"type": "ping"}))
        assert await recv(ws) == {"type": "pong"}
    async with connect(pipeline, 1) as ws:
        await ws.send(json.dumps({"type": "resume", "id": "y", "request_id": rid, "after": 0}))
        frames = await until_end(ws, "y")
        assert frames[-1]["type"] == "done"


async def test_cancel_a_resumed_stream(pipeline: Pipeline, backend: FakeBackend) -> None:
    marker = f"wsrcancel-{uuid.uuid4().hex}"
    async with connect(pipeline, 0) as ws:
        await ws.send(request("g", marker, 100000, resume_grace=30))
        frames = [await recv(ws)]
        rid = frames[0]["request_id"]
        while (await recv(ws))["type"] != "chunk":
            pass
        ws.transport.abort()
    async with connect(pipeline, 1) as ws:
        await ws.send(json.dumps({"type": "resume", "id": "r", "request_id": rid, "after": 0}))
        while (await recv(ws))["type"] != "chunk":
            pass
        await ws.send(json.dumps({"type": "cancel", "id": "r"}))
        end = await until_end(ws, "r")
        assert end[-1] == {"type": "cancelled", "id": "r"}
    assert await wait_for(lambda: any(r.closed_at for r in record_for(backend, marker)), 10.0)


async def test_drain_tells_resumable_generations_to_reconnect(
        tmp_path: Path, module_nats_url: str, module_redis_url: str,
        backend: FakeBackend) -> None:
    p = _pipeline(tmp_path, module_nats_url, module_redis_url, backend)
    marker = f"wsdrainr-{uuid.uuid4().hex}"
    try:
        p.start()
        async with connect(p, 0) as ws:
            await ws.send(request("g", marker, 400))
            first: list[dict[str, Any]] = []
            while sum(f["type"] == "chunk" for f in first) < 5:
                first.append(await recv(ws))
            p.edge.terminate()  # SIGTERM edge 0
            terminated = time.monotonic()
            frames = list(first)
            with contextlib.suppress(websockets.ConnectionClosed):
                while True:
                    frames.append(await recv(ws))
            assert ws.close_code == 1012
            # At once, not after edge.shutdown_timeout (4 s), which is what a
            # non-resumable generation would be given before it is ended.
            assert time.monotonic() - terminated < 4.0
        reconnect = frames[-1]
        assert reconnect["type"] == "reconnect"
        assert reconnect["request_id"] == first[0]["request_id"]
        got = chunk_data(frames)
        assert reconnect["after"] == got[-1][0]
        async with connect(p, 1) as ws:
            await ws.send(json.dumps({"type": "resume", "id": "g", "request_id":
                                      reconnect["request_id"], "after": reconnect["after"]}))
            rest = await until_end(ws, "g")
        assert rest[-1]["type"] == "done"
        got += chunk_data(rest)
        assert [seq for seq, _ in got] == list(range(1, len(got) + 1))
        assert rest[-1]["usage"]["completion_tokens"] == 400
    finally:
        p.stop()


async def test_drain_tells_a_resumed_generation_to_reconnect_after_its_last_chunk(
        tmp_path: Path, module_nats_url: str, module_redis_url: str,
        backend: FakeBackend) -> None:
    """A ``resume`` generation on a draining edge (issue 26): its reader is not
    cancelled mid-read (which could count an event it never sent); it ends
    with ``reconnect`` whose ``after`` is the last chunk it sent, the socket
    closes 1012, and resuming there loses and repeats nothing."""
    p = _pipeline(tmp_path, module_nats_url, module_redis_url, backend)
    marker = f"wsdrainresumed-{uuid.uuid4().hex}"
    try:
        p.start()
        async with connect(p, 1) as live:
            await live.send(request("g", marker, 400))
            accepted = await recv(live)
            request_id = accepted["request_id"]
            async with connect(p, 0) as ws:
                await ws.send(json.dumps({"type": "resume", "id": "r",
                                          "request_id": request_id, "after": 0}))
                frames: list[dict[str, Any]] = []
                while sum(f["type"] == "chunk" for f in frames) < 5:
                    frames.append(await recv(ws))
                p.edge.terminate()  # SIGTERM edge 0, the resumed reader's
                with contextlib.suppress(websockets.ConnectionClosed):
                    while True:
                        frames.append(await recv(ws))
                assert ws.close_code == 1012
        got = chunk_data(frames)
        assert frames[-1] == {"type": "reconnect", "id": "r", "request_id": request_id,
                              "after": got[-1][0]}
        async with connect(p, 1) as ws:
            await ws.send(json.dumps({"type": "resume", "id": "r", "request_id": request_id,
                                      "after": frames[-1]["after"]}))
            rest = await until_end(ws, "r")
        assert rest[-1]["type"] == "done"
        got += chunk_data(rest)
        assert [seq for seq, _ in got] == list(range(1, len(got) + 1))
    finally:
        p.stop()


async def test_an_evicted_socket_leaves_its_resumable_generation_its_grace(
        pipeline: Pipeline, backend: FakeBackend) -> None:
    # aiohttp with autoping off never answers a ping: the socket is evicted.
    # A token every 0.5 s leaves the socket idle long enough to be pinged.
    marker = f"wsevictr-{uuid.uuid4().hex}"
    async with aiohttp.ClientSession() as session, session.ws_connect(
            url(pipeline, 0), autoping=False,
            headers={"Authorization": f"Bearer {DEV_KEY}"}) as ws:
        await ws.send_str(request("g", marker, 12, {"fake_itl": 0.5}, resume_grace=20))
        frames: list[dict[str, Any]] = []
        async for msg in ws:
            if msg.type is aiohttp.WSMsgType.TEXT:
                frames.append(json.loads(msg.data))
            elif msg.type is not aiohttp.WSMsgType.PING:
                break
        assert ws.close_code in (1011, 1006, None)
    assert frames[0]["type"] == "accepted"
    assert "done" not in [f["type"] for f in frames]
    rid = frames[0]["request_id"]
    seen = [f["seq"] for f in frames if f["type"] == "chunk"]
    # Not cancelled: resumed on the other edge, it runs to its end.
    async with connect(pipeline, 1) as ws2:
        await ws2.send(json.dumps({"type": "resume", "id": "g", "request_id": rid,
                                   "after": seen[-1] if seen else 0}))
        rest = await until_end(ws2, "g")
    assert rest[-1]["type"] == "done"
    assert rest[-1]["usage"]["completion_tokens"] == 12
    record = record_for(backend, marker)[0]
    assert record.completed
    assert record.closed_at is None
