"""WebSocket ingress (GET /v1/ws) against the real pipeline: edge, dispatcher
and worker processes, a real nats-server and redis-server, and the fake
OpenAI backend, which records what it saw (closes included)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import re
import socket
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
    # No natural end: max_tokens decides every length; slow enough to cancel mid-way.
    with threaded_fake_backend(models=["fake"], ttft=0.01, itl=0.01, tokens=10**9) as fake:
        yield fake


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory: pytest.TempPathFactory, module_nats_url: str,
             module_redis_url: str, backend: FakeBackend) -> Iterator[Pipeline]:
    p = Pipeline(tmp_path_factory.mktemp("ws"), module_nats_url, module_redis_url, overrides={
        "nats": {"subject_prefix": "t" + uuid.uuid4().hex[:8]},
        "ws": {"max_concurrent": 3, "max_message_bytes": 64 << 10, "auth_timeout": 2.0,
               "idle_before_ping": 0.4, "ping_interval": 0.3, "pong_timeout": 0.3,
               "max_missed_pongs": 2},
        "models": [{"name": "fake", "backend": "openai", "base_url": backend.base_url,
                    "max_streams": 64},
                   {"name": "tidegate-sim", "aliases": ["sim"],
                    "simulator": {"ttft": 0.01, "tokens_per_second": 400.0, "length": 32}}],
    })
    try:
        p.start()
        yield p
    finally:
        p.stop()


def ws_url(p: Pipeline) -> str:
    return f"ws://127.0.0.1:{p.port}/v1/ws"


def connect(p: Pipeline, key: str | None = DEV_KEY) -> Any:
    headers = {"Authorization": f"Bearer {key}"} if key else None
    return ws_connect(ws_url(p), additional_headers=headers, max_size=None)


def chat(marker: str, **extra: Any) -> dict[str, Any]:
    return {"model": "fake", "messages": [{"role": "user", "content": marker}], **extra}


async def recv(ws: ClientConnection, within: float = 20.0) -> dict[str, Any]:
    raw = await asyncio.wait_for(ws.recv(), within)
    frame: dict[str, Any] = json.loads(raw)
    return frame


async def collect(ws: ClientConnection, ids: set[str],
                  within: float = 30.0) -> dict[str, list[dict[str, Any]]]:
    """Every frame of the generations ``ids`` until each has ended."""
    out: dict[str, list[dict[str, Any]]] = {i: [] for i in ids}
    open_ = set(ids)
    deadline = time.monotonic() + within
    while open_:
        frame = await recv(ws, deadline - time.monotonic())
        gid = frame.get("id")
        if gid in out:
            out[gid].append(frame)
            if frame["type"] in ("done", "error", "cancelled"):
                open_.discard(gid)
    return out


async def until_closed(ws: ClientConnection) -> tuple[list[dict[str, Any]], int | None]:
    """Every frame until the server closes; and its close code."""
    frames: list[dict[str, Any]] = []
    async with asyncio.timeout(30):
        with contextlib.suppress(websockets.ConnectionClosed):
            async for raw in ws:
                frames.append(json.loads(raw))
    return frames, ws.close_code


def normalise(text: str, request_id: str) -> str:
    # Each request has its own id and clock second; everything else is equal.
    return re.sub(r'"created":\d+', '"created":0', text.replace(request_id, "RID"))


async def sse_events(p: Pipeline, body: dict[str, Any]) -> tuple[list[str], str]:
    async with aiohttp.ClientSession() as session, session.post(
            f"{p.base_url}/chat/completions", json={**body, "stream": True},
            headers={"Authorization": f"Bearer {DEV_KEY}"}) as resp:
        assert resp.status == 200
        events = [line[6:].decode().rstrip("\n") async for line in resp.content
                  if line.startswith(b"data: ")]
        return events, resp.headers["x-request-id"]


async def test_two_generations_interleave_byte_exact_against_sse(pipeline: Pipeline) -> None:
    body = {"model": "sim", "max_tokens": 24, "seed": 7,
            "messages": [{"role": "user", "content": "interleave"}]}
    sse, sse_rid = await sse_events(pipeline, body)
    assert sse[-1] == "[DONE]"
    expected = [normalise(e, sse_rid) for e in sse[:-1]]

    async with connect(pipeline) as ws:
        for gid in ("a", "b"):
            await ws.send(json.dumps({"type": "request", "id": gid,
                                      "path": "/v1/chat/completions", "body": body}))
        order: list[str] = []
        frames: dict[str, list[dict[str, Any]]] = {"a": [], "b": []}
        raw_chunks: dict[str, list[str]] = {"a": [], "b": []}
        ended: set[str] = set()
        while ended != {"a", "b"}:
            raw = await asyncio.wait_for(ws.recv(), 20)
            assert isinstance(raw, str)
            frame = json.loads(raw)
            frames[frame["id"]].append(frame)
            if frame["type"] == "chunk":
                order.append(frame["id"])
                # The data is the worker's bytes as they were: take them out of
                # the raw frame text, not from a re-serialised parse.
                m = re.fullmatch(r'\{"type":"chunk","id":"[ab]","seq":\d+,"data":(.*)\}', raw)
                assert m is not None, raw
                raw_chunks[frame["id"]].append(m.group(1))
            if frame["type"] in ("done", "error", "cancelled"):
                ended.add(frame["id"])

    for gid in ("a", "b"):
        kinds = [f["type"] for f in frames[gid]]
        assert kinds[0] == "accepted", kinds
        assert kinds[-1] == "done", kinds
        rid = frames[gid][0]["request_id"]
        assert len(rid) >= 24  # 96 random bits, hex
        assert [normalise(c, rid) for c in raw_chunks[gid]] == expected
        seqs = [f["seq"] for f in frames[gid] if f["type"] == "chunk"]
        assert seqs == list(range(1, len(seqs) + 1))
        done = frames[gid][-1]
        assert done["usage"]["completion_tokens"] == 24
    # Both ran at once on the one socket: their chunks are interleaved.
    first_b, last_a = order.index("b"), len(order) - 1 - order[::-1].index("a")
    assert first_b < last_a, order


async def test_cancel_one_the_other_completes_and_backend_sees_the_close(
        pipeline: Pipeline, backend: FakeBackend) -> None:
    cancel_marker, keep_marker = f"cancel-{uuid.uuid4().hex}", f"keep-{uuid.uuid4().hex}"
    async with connect(pipeline) as ws:
        await ws.send(json.dumps({"type": "request", "id": "long", "path": "/v1/chat/completions",
                                  "body": chat(cancel_marker, max_tokens=100000)}))
        await ws.send(json.dumps({"type": "request", "id": "short",
                                  "path": "/v1/chat/completions",
                                  "body": chat(keep_marker, max_tokens=150)}))
        seen_long = 0
        frames: dict[str, list[dict[str, Any]]] = {"long": [], "short": []}
        while seen_long < 5:
            frame = await recv(ws)
            frames[frame["id"]].append(frame)
            if frame["id"] == "long" and frame["type"] == "chunk":
                seen_long += 1
        cancelled_at = time.monotonic()
        await ws.send(json.dumps({"type": "cancel", "id": "long"}))
        rest = await collect(ws, {"long", "short"})
        for gid in rest:
            frames[gid] += rest[gid]
        assert frames["long"][-1] == {"type": "cancelled", "id": "long"}
        assert frames["short"][-1]["type"] == "done"
        assert sum(f["type"] == "chunk" for f in frames["short"]) >= 150
        # The socket is still good for more.
        await ws.send(json.dumps({"type": "ping"}))
        assert await recv(ws) == {"type": "pong"}

    assert await wait_for(lambda: any(r.closed_at for r in record_for(backend, cancel_marker)),
                          10.0)
    record = record_for(backend, cancel_marker)[0]
    assert record.closed_at is not None
    assert not record.completed
    # Causality and a loose bound: the close follows the cancel, well inside a
    # loaded CI's margin (the p99 bound is the bench's to measure).
    assert 0 <= record.closed_at - cancelled_at < 2.0
    keep = record_for(backend, keep_marker)[0]
    assert keep.completed
    assert keep.closed_at is None


async def test_malformed_frames_get_error_frames_and_the_socket_survives(
        pipeline: Pipeline) -> None:
    async with connect(pipeline) as ws:
        async def expect(frame: str | bytes, code: str, id: str | None = None) -> None:
            await ws.send(frame)
            answer = await recv(ws)
            while answer["type"] in ("accepted", "chunk"):  # a running generation's
                answer = await recv(ws)
            assert answer["type"] == "error", answer
            assert answer["error"]["code"] == code, answer
            assert answer.get("id") == id

        await expect("{not json", "invalid_json")
        await expect(b"\x00\x01binary", "binary_frame")
        await expect("[1, 2]", "invalid_json")  # the HTTP body parser's rule: an object
        await expect('{"type": "ping", "type": "pong"}', "invalid_json")  # duplicate key
        await expect('{"type": "request", "id": "deep", "path": "/v1/completions", "body": '
                     + "[" * 100 + "]" * 100 + "}", "invalid_json")
        await expect('{"type": "subscribe", "id": "x"}', "unknown_type", "x")
        await expect('{"id": "x"}', "invalid_frame", "x")
        await expect('{"type": "request", "path": "/v1/chat/completions", "body": {}}',
                     "invalid_id")
        await expect(json.dumps({"type": "request", "id": "p", "path": "/v1/embeddings",
                                 "body": chat("x")}), "unknown_path", "p")
        await expect(json.dumps({"type": "request", "id": "b", "path": "/v1/chat/completions",
                                 "body": "text"}), "invalid_body", "b")
        # Validation is the SSE route's: a missing model is its error.
        await expect(json.dumps({"type": "request", "id": "v", "path": "/v1/chat/completions",
                                 "body": {"messages": []}}), "missing_required_parameter", "v")
        await expect(json.dumps({"type": "cancel", "id": "nobody"}), "unknown_id", "nobody")
        await expect(json.dumps({"type": "auth", "key": DEV_KEY}), "already_authenticated")
        # A duplicate id while the first is running; then too many at once (limit 3).
        start = {"type": "request", "path": "/v1/chat/completions",
                 "body": chat("dup", max_tokens=100000)}
        await ws.send(json.dumps({**start, "id": "d1"}))
        assert (await recv(ws))["type"] == "accepted"
        await expect(json.dumps({**start, "id": "d1"}), "duplicate_id", "d1")
        await ws.send(json.dumps({"type": "cancel", "id": "d1"}))
        ended = await collect(ws, {"d1"})
        assert ended["d1"][-1] == {"type": "cancelled", "id": "d1"}
        # Still alive after all of it: a new generation runs to the end.
        await ws.send(json.dumps({"type": "request", "id": "ok", "path": "/v1/completions",
                                  "body": {"model": "sim", "prompt": "hi", "max_tokens": 3}}))
        final = (await collect(ws, {"ok"}))["ok"]
        assert final[-1]["type"] == "done"
        assert final[-1]["usage"]["completion_tokens"] == 3


async def test_too_many_concurrent(pipeline: Pipeline) -> None:
    async with connect(pipeline) as ws:
        start = {"type": "request", "path": "/v1/chat/completions",
                 "body": chat("limit", max_tokens=100000)}
        for i in range(4):
            await ws.send(json.dumps({**start, "id": f"g{i}"}))
        errors: list[dict[str, Any]] = []
        while not errors:
            frame = await recv(ws)
            if frame["type"] == "error":
                errors.append(frame)
        assert errors[0]["id"] == "g3"
        assert errors[0]["error"]["code"] == "too_many_concurrent"
        assert errors[0]["error"]["retryable"] is True


async def test_oversize_frame_closes_1009(pipeline: Pipeline) -> None:
    async with connect(pipeline) as ws:
        await ws.send(json.dumps({"type": "ping", "pad": "x" * (70 << 10)}))
        with pytest.raises(websockets.ConnectionClosed) as info:
            await recv(ws)
        assert info.value.rcvd is not None
        assert info.value.rcvd.code == 1009


async def test_first_message_auth(pipeline: Pipeline) -> None:
    async with connect(pipeline, key=None) as ws:
        await ws.send(json.dumps({"type": "auth", "key": DEV_KEY}))
        await ws.send(json.dumps({"type": "request", "id": "x", "path": "/v1/completions",
                                  "body": {"model": "sim", "prompt": "hi", "max_tokens": 2}}))
        frames = (await collect(ws, {"x"}))["x"]
        assert frames[-1]["type"] == "done"
    async with connect(pipeline, key=None) as ws:
        await ws.send(json.dumps({"type": "auth", "key": "sk-wrong-key-000000"}))
        with pytest.raises(websockets.ConnectionClosed) as info:
            await recv(ws)
        assert info.value.rcvd is not None
        assert info.value.rcvd.code == 4401
        assert info.value.rcvd.reason.startswith("invalid_api_key")
    async with connect(pipeline, key=None) as ws:
        await ws.send(json.dumps({"type": "request", "id": "x", "path": "/v1/completions",
                                  "body": {"model": "sim", "prompt": "hi"}}))
        with pytest.raises(websockets.ConnectionClosed) as info:
            await recv(ws)
        assert info.value.rcvd is not None
        assert info.value.rcvd.code == 4401
    async with connect(pipeline, key=None) as ws:  # says nothing: auth_timeout (2 s)
        with pytest.raises(websockets.ConnectionClosed) as info:
            await recv(ws, within=10)
        assert info.value.rcvd is not None
        assert info.value.rcvd.code == 4408


async def test_bad_bearer_header_is_a_401_before_the_upgrade(pipeline: Pipeline) -> None:
    with pytest.raises(websockets.InvalidStatus) as info:
        async with connect(pipeline, key="sk-wrong-key-000000"):
            pass
    assert info.value.response.status_code == 401
    assert b"invalid_api_key" in info.value.response.body


async def test_silent_client_is_evicted_after_the_missed_pongs(pipeline: Pipeline) -> None:
    # aiohttp's client with autoping off answers no protocol ping: a dead peer.
    async with aiohttp.ClientSession() as session, session.ws_connect(
            ws_url(pipeline), autoping=False,
            headers={"Authorization": f"Bearer {DEV_KEY}"}) as ws:
        # A generation that waits long before its first token: the socket is idle.
        await ws.send_str(json.dumps({"type": "request", "id": "g", "path":
                                      "/v1/chat/completions",
                                      "body": chat("evict", max_tokens=5)}))
        started = time.monotonic()
        pings = 0
        closed_code = None
        async for msg in ws:
            if msg.type is aiohttp.WSMsgType.PING:
                pings += 1
            elif msg.type is aiohttp.WSMsgType.TEXT:
                frame = json.loads(msg.data)
                if frame["type"] == "chunk":
                    # Stop reading text but keep ignoring pings: only pings matter now.
                    pass
            elif msg.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED,
                              aiohttp.WSMsgType.ERROR):
                closed_code = ws.close_code
                break
        elapsed = time.monotonic() - started
    assert pings >= 2, pings
    assert closed_code in (1011, 1006, None)
    # idle 0.4 + 2 x (pong 0.3) at the least; a loaded CI gets a wide margin.
    assert 0.9 <= elapsed < 15, elapsed


async def test_eviction_closes_the_backend_call(pipeline: Pipeline,
                                                backend: FakeBackend) -> None:
    # A token every 3 s: the socket idles between them, the pings go
    # unanswered, the socket is evicted, and the generation is cancelled.
    marker = f"evictbk-{uuid.uuid4().hex}"
    async with aiohttp.ClientSession() as session, session.ws_connect(
            ws_url(pipeline), autoping=False,
            headers={"Authorization": f"Bearer {DEV_KEY}"}) as ws:
        await ws.send_str(json.dumps({"type": "request", "id": "g",
                                      "path": "/v1/chat/completions",
                                      "body": chat(marker, max_tokens=1000, fake_itl=3.0)}))
        kinds: list[str] = []
        async for msg in ws:
            if msg.type is aiohttp.WSMsgType.TEXT:
                kinds.append(json.loads(msg.data)["type"])
            elif msg.type is not aiohttp.WSMsgType.PING:
                break
        evicted_at = time.monotonic()
        assert ws.close_code in (1011, 1006, None)
    assert "done" not in kinds
    assert await wait_for(lambda: any(r.closed_at for r in record_for(backend, marker)),
                          15.0, step=0.05)
    record = record_for(backend, marker)[0]
    assert not record.completed
    assert record.closed_at is not None
    # The backend learns at its next write (within one 3 s token gap).
    assert record.closed_at - evicted_at < 8.0


async def test_no_eviction_while_tokens_flow(pipeline: Pipeline) -> None:
    # Tokens every 10 ms, far under idle_before_ping (0.4 s): no ping is ever
    # sent, so a client that would not answer one is never evicted.
    async with aiohttp.ClientSession() as session, session.ws_connect(
            ws_url(pipeline), autoping=False,
            headers={"Authorization": f"Bearer {DEV_KEY}"}) as ws:
        await ws.send_str(json.dumps({"type": "request", "id": "g",
                                      "path": "/v1/chat/completions",
                                      "body": chat("flow", max_tokens=250)}))
        pings = 0
        last: dict[str, Any] = {}
        async for msg in ws:
            if msg.type is aiohttp.WSMsgType.PING:
                pings += 1
            elif msg.type is aiohttp.WSMsgType.TEXT:
                last = json.loads(msg.data)
                if last["type"] in ("done", "error"):
                    break
            else:
                break
        assert last.get("type") == "done", last
        assert pings == 0


async def test_drain_closes_1012_after_ending_generations(
        tmp_path_factory: pytest.TempPathFactory, module_nats_url: str, module_redis_url: str,
        backend: FakeBackend) -> None:
    p = Pipeline(tmp_path_factory.mktemp("wsdrain"), module_nats_url, module_redis_url,
                 overrides={
                     "nats": {"subject_prefix": "t" + uuid.uuid4().hex[:8]},
                     "edge": {"shutdown_timeout": 2.0},
                     "models": [{"name": "fake", "backend": "openai",
                                 "base_url": backend.base_url}]})
    marker = f"drain-{uuid.uuid4().hex}"
    try:
        p.start()
        async with connect(p) as idle, connect(p) as busy:
            await busy.send(json.dumps({"type": "request", "id": "g",
                                        "path": "/v1/chat/completions",
                                        "body": chat(marker, max_tokens=100000)}))
            while (await recv(busy))["type"] != "chunk":
                pass
            p.edge.terminate()  # SIGTERM
            # The idle socket closes at once with 1012 (service restart) ...
            with pytest.raises(websockets.ConnectionClosed) as info:
                await recv(idle, within=10)
            assert info.value.rcvd is not None
            assert info.value.rcvd.code == 1012
            # ... the busy one after its generation was ended (shutdown_timeout).
            frames, code = await until_closed(busy)
            assert code == 1012
            last = frames[-1]
            assert last["type"] == "error"
            assert last["id"] == "g"
            assert last["error"]["code"] == "edge_shutting_down"
            assert last["error"]["retryable"] is True
        assert await wait_for(lambda: any(r.closed_at for r in record_for(backend, marker)),
                              10.0)
    finally:
        p.stop()


def test_the_python_example_in_the_docs_runs(pipeline: Pipeline) -> None:
    """docs/websocket.md's Python example, as written, against this edge."""
    import subprocess
    import sys

    doc = (Path(__file__).parent.parent / "docs" / "websocket.md").read_text()
    code = doc.split("## Python (`websockets`)", 1)[1].split("```python\n", 1)[1]
    code = code.split("```", 1)[0]
    code = code.replace("ws://127.0.0.1:8080", f"ws://127.0.0.1:{pipeline.port}")
    code = code.replace("sk-...", DEV_KEY)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert any(line.startswith("a done {'prompt_tokens'") for line in lines), done.stdout
    assert any(line.startswith(("b cancelled", "b done")) for line in lines), done.stdout


def _gauge(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no {name} in the edge's metrics")


async def test_metrics_count_sockets_and_generations(pipeline: Pipeline) -> None:
    async with connect(pipeline) as ws, connect(pipeline):
        await ws.send(json.dumps({"type": "request", "id": "m", "path": "/v1/chat/completions",
                                  "body": chat("metrics", max_tokens=100000)}))
        while (await recv(ws))["type"] != "chunk":
            pass
        text = await asyncio.to_thread(pipeline.scrape, "edge")
        assert _gauge(text, "tidegate_edge_ws_connections_active") >= 2
        assert _gauge(text, "tidegate_edge_ws_generations_active") >= 1
        await ws.send(json.dumps({"type": "cancel", "id": "m"}))
        await collect(ws, {"m"})

    def counts() -> tuple[float, float]:
        text = pipeline.scrape("edge")
        return (_gauge(text, "tidegate_edge_ws_connections_active"),
                _gauge(text, "tidegate_edge_ws_generations_active"))

    assert await wait_for(lambda: counts() == (0.0, 0.0), 10.0, step=0.2)


def _client_frame(payload: bytes) -> bytes:
    """A masked client TEXT frame (RFC 6455 5.3)."""
    mask = os.urandom(4)
    n = len(payload)
    header = bytes([0x81, 0x80 | n]) if n < 126 else bytes([0x81, 0x80 | 126]) + n.to_bytes(
        2, "big")
    return header + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload))


async def test_a_socket_that_stops_reading_is_dropped_and_its_generations_cancelled(
        tmp_path_factory: pytest.TempPathFactory, module_nats_url: str, module_redis_url: str,
        backend: FakeBackend) -> None:
    p = Pipeline(tmp_path_factory.mktemp("wsslow"), module_nats_url, module_redis_url,
                 overrides={
                     "nats": {"subject_prefix": "t" + uuid.uuid4().hex[:8]},
                     "edge": {"slow_client_timeout": 2.0},
                     # An endless answer: past the default bound on max_tokens.
                     "models": [{"name": "fake", "backend": "openai",
                                 "base_url": backend.base_url, "max_output_tokens": 10**7}]})
    markers = [f"slow{i}-{uuid.uuid4().hex}" for i in range(2)]
    try:
        p.start()
        # A raw client with a tiny receive buffer that never reads after the
        # handshake: the edge's socket buffer fills, then its drain waits.
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", p.port))
        reader, writer = await asyncio.open_connection(sock=sock, limit=1024)
        key = base64.b64encode(os.urandom(16)).decode()
        writer.write(f"GET /v1/ws HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\n"
                     f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\n"
                     f"Sec-WebSocket-Version: 13\r\nAuthorization: Bearer {DEV_KEY}\r\n\r\n"
                     .encode())
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        assert head.startswith(b"HTTP/1.1 101")
        for i, marker in enumerate(markers):
            writer.write(_client_frame(json.dumps({
                "type": "request", "id": f"s{i}", "path": "/v1/chat/completions",
                "body": chat(marker, max_tokens=10**7, fake_itl=0.0)}).encode()))
        await writer.drain()
        started = time.monotonic()
        # Never read again. Both generations are cancelled once the socket has
        # not drained for slow_client_timeout (the buffers take a while to fill).
        assert await wait_for(lambda: all(
            any(r.closed_at for r in record_for(backend, m)) for m in markers), 60.0, step=0.1)
        elapsed = time.monotonic() - started
        assert elapsed >= 2.0  # not before the slow-client limit
        for m in markers:
            record = record_for(backend, m)[0]
            assert not record.completed
            # Backpressure reached the backend: it wrote a bounded amount (the
            # kernel's socket buffers and one credit window), not 10^7 tokens.
            assert record.bytes_written < 32 << 20  # seen: 4-7 MB, mostly kernel buffers
        writer.close()
    finally:
        p.stop()


async def test_status_counts_websockets_and_generations(pipeline: Pipeline) -> None:
    import subprocess
    import sys

    def status() -> dict[str, Any]:
        done = subprocess.run([sys.executable, "-m", "fleet", "status", "--json",
                               "--interval", "0.1", "--config", str(pipeline.config_path)],
                              capture_output=True, text=True, timeout=30)
        assert done.returncode == 0, done.stderr
        edges: dict[str, Any] = json.loads(done.stdout)["edges"]
        return edges

    async with connect(pipeline) as ws, connect(pipeline):
        await ws.send(json.dumps({"type": "request", "id": "s", "path": "/v1/chat/completions",
                                  "body": chat("status", max_tokens=100000)}))
        while (await recv(ws))["type"] != "chunk":
            pass
        deadline = time.monotonic() + 20  # the edge puts its entry every 2 s here
        while True:
            edges = await asyncio.to_thread(status)
            total = edges["total"]
            if total["ws_connections"] >= 2 and total["ws_generations"] >= 1:
                break
            assert time.monotonic() < deadline, edges
            await asyncio.sleep(0.2)
        assert total["edges"] == 1
        assert total["streams"] >= 1
        assert edges["edges"][0]["ws_connections"] == total["ws_connections"]
        await ws.send(json.dumps({"type": "cancel", "id": "s"}))
        await collect(ws, {"s"})
