"""A WebSocket follows its API key (issue 24, item 4), on the real pipeline:
a key revoked with ``tidegate keys revoke`` (a delete in the keys bucket) or
past its expiry closes every socket it opened with 4401, idle or streaming,
and no ``request`` or ``resume`` frame after the revoke starts anything.

The tests wait for events (the edge refusing the key over HTTP, the close
frame), never for a fixed time.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import aiohttp
import pytest
import websockets
from websockets.asyncio.client import ClientConnection
from websockets.asyncio.client import connect as ws_connect

from tests.pipeline import Pipeline, running_pipeline
from tidegate.broker import broker
from tidegate.control import keys as tgkeys

pytestmark = pytest.mark.pipeline

BODY = {"model": "sim", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
LONG = {"model": "slow", "max_tokens": 100_000,
        "messages": [{"role": "user", "content": "a long one"}]}


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory: pytest.TempPathFactory, module_nats_url: str,
             module_redis_url: str) -> Iterator[Pipeline]:
    yield from running_pipeline(
        tmp_path_factory.mktemp("wsrevoke"), module_nats_url, module_redis_url, overrides={
            "nats": {"subject_prefix": "r" + uuid.uuid4().hex[:8]},
            "models": [{"name": "tidegate-sim", "aliases": ["sim"],
                        "simulator": {"ttft": 0.01, "tokens_per_second": 400.0,
                                      "length": 32}},
                       {"name": "slow", "simulator": {"ttft": 0.01, "tokens_per_second": 20.0,
                                                      "length": 100_000}}]})


@contextlib.asynccontextmanager
async def keys_bucket(pipeline: Pipeline) -> AsyncIterator[Any]:
    nc = await broker.connect(pipeline.config.nats, "tidegate-admin-test")
    try:
        js = broker.jetstream(nc, pipeline.config.nats)
        yield await tgkeys.ensure_keys_bucket(js, pipeline.config)
    finally:
        await nc.close()


async def new_key(pipeline: Pipeline, expires_in: float = 0.0) -> str:
    async with keys_bucket(pipeline) as kv:
        key, _ = await tgkeys.create_key(kv, "acme", "al", expires_in=expires_in)
    await until_http(pipeline, key, 200)  # the edge's watch has it
    return key


async def revoke(pipeline: Pipeline, key: str) -> None:
    async with keys_bucket(pipeline) as kv:
        assert await tgkeys.revoke_key(kv, tgkeys.key_digest(key)[:12])


async def until_http(pipeline: Pipeline, key: str, status: int) -> None:
    """Until a chat request with ``key`` gets ``status`` (the edge's key table
    has caught up)."""
    async with aiohttp.ClientSession() as http, asyncio.timeout(30):
        while True:
            async with http.post(f"{pipeline.base_url}/chat/completions", json=BODY,
                                 headers={"Authorization": f"Bearer {key}"}) as resp:
                if resp.status == status:
                    return
            await asyncio.sleep(0.05)


def connect(pipeline: Pipeline, key: str) -> Any:
    return ws_connect(f"ws://127.0.0.1:{pipeline.port}/v1/ws",
                      additional_headers={"Authorization": f"Bearer {key}"}, max_size=None)


def request(gid: str, body: dict[str, Any]) -> str:
    return json.dumps({"type": "request", "id": gid, "path": "/v1/chat/completions",
                       "body": body})


async def until_closed(ws: ClientConnection) -> list[dict[str, Any]]:
    """Every frame until the server closes the socket (or a frame shows a
    generation started, which no test here expects)."""
    frames: list[dict[str, Any]] = []
    async with asyncio.timeout(30):
        with contextlib.suppress(websockets.ConnectionClosed):
            async for raw in ws:
                frames.append(json.loads(raw))
                if frames[-1]["type"] == "accepted":
                    break
    return frames


async def one_generation(ws: ClientConnection, gid: str) -> None:
    await ws.send(request(gid, BODY))
    async with asyncio.timeout(30):
        while True:
            frame = json.loads(await ws.recv())
            if frame.get("id") == gid and frame["type"] in ("done", "error"):
                assert frame["type"] == "done", frame
                return


def close_reason(ws: ClientConnection) -> tuple[int | None, str]:
    rcvd = ws.protocol.close_rcvd
    assert rcvd is not None, "the edge did not send a close frame"
    return rcvd.code, rcvd.reason


async def test_an_idle_socket_closes_4401_when_its_key_is_revoked(pipeline: Pipeline) -> None:
    key = await new_key(pipeline)
    async with connect(pipeline, key) as ws:
        await one_generation(ws, "before")
        await revoke(pipeline, key)
        frames = await until_closed(ws)
        assert frames == []
        code, reason = close_reason(ws)
    assert code == 4401
    assert reason.startswith("revoked_api_key")
    assert key not in reason


async def test_a_streaming_socket_closes_4401_and_its_generation_ends(
        pipeline: Pipeline) -> None:
    key = await new_key(pipeline)
    async with connect(pipeline, key) as ws:
        await ws.send(request("long", LONG))
        async with asyncio.timeout(30):
            while json.loads(await ws.recv())["type"] != "chunk":  # it runs
                pass
        await revoke(pipeline, key)
        frames = await until_closed(ws)
        assert "done" not in [f["type"] for f in frames]
        assert close_reason(ws)[0] == 4401


async def test_no_request_or_resume_frame_runs_after_the_revoke(pipeline: Pipeline) -> None:
    key = await new_key(pipeline)
    async with connect(pipeline, key) as ws:
        await one_generation(ws, "before")
        await revoke(pipeline, key)
        await until_http(pipeline, key, 401)  # this edge no longer takes the key
        with contextlib.suppress(websockets.ConnectionClosed):
            await ws.send(request("after", BODY))
            await ws.send(json.dumps({"type": "resume", "id": "again",
                                      "request_id": "0" * 24}))
        frames = await until_closed(ws)
        started = [f for f in frames if f["type"] in ("accepted", "chunk", "done")]
        assert started == [], frames
        for frame in frames:  # at most the refusal of a frame that raced the close
            assert frame["type"] == "error", frame
            assert frame["error"]["code"] == "revoked_api_key"
        assert close_reason(ws)[0] == 4401


async def test_a_socket_closes_4401_when_its_key_expires(pipeline: Pipeline) -> None:
    key = await new_key(pipeline, expires_in=6.0)
    async with connect(pipeline, key) as ws:
        frames = await until_closed(ws)  # idle: the expiry alone closes it
        assert frames == []
        code, reason = close_reason(ws)
    assert code == 4401
    assert reason.startswith("expired_api_key")


async def test_a_client_sending_through_the_revoke_still_reads_the_4401(
        pipeline: Pipeline) -> None:
    """The close is a handshake, not a drop: frames the client sends while
    the edge closes (here a stream of pings) must not reset the connection
    before the client has read the Close frame and its code."""
    key = await new_key(pipeline)
    async with connect(pipeline, key) as ws:
        await one_generation(ws, "before")

        async def chatter() -> None:
            with contextlib.suppress(websockets.ConnectionClosed):
                while True:
                    await ws.send(json.dumps({"type": "ping"}))
                    await asyncio.sleep(0)

        sender = asyncio.create_task(chatter())
        try:
            await revoke(pipeline, key)
            frames = await until_closed(ws)
        finally:
            sender.cancel()
        assert {f["type"] for f in frames} <= {"pong"}, frames
        assert close_reason(ws)[0] == 4401
