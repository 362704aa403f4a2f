"""gRPC ingress (edge.grpc_port, docs/grpc.md) against the real pipeline:
edge, dispatcher and worker processes, a real nats-server and redis-server,
the simulator and the fake OpenAI backend (which records closes), driven by
a grpcio client with the checked-in stubs."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import nats
import pytest

from bench.fake_backend import FakeBackend
from fleet.run.servers import free_port
from tests.pipeline import DEV_KEY, Pipeline, record_for, threaded_fake_backend, wait_for
from tidegate.control.keys import create_key, ensure_keys_bucket
from tidegate.control.policies import Policy, ensure_policies_bucket, set_policy
from tidegate.wire import gateway_pb2 as pb
from tidegate.wire import gateway_pb2_grpc as pb_grpc

pytestmark = pytest.mark.pipeline

CHAT = pb.ROUTE_CHAT_COMPLETIONS


@pytest.fixture(scope="module")
def backend() -> Iterator[FakeBackend]:
    # No natural end: max_tokens decides every length; slow enough to cancel mid-way.
    with threaded_fake_backend(models=["fake"], ttft=0.01, itl=0.01, tokens=10**9) as fake:
        yield fake


@pytest.fixture(scope="module")
def big() -> Iterator[FakeBackend]:
    # ~200 MB of output if nothing pushed back (the slow-reader test).
    with threaded_fake_backend(models=["big"], ttft=0.0, itl=0.0, tokens=50_000,
                               token_size=4096) as fake:
        yield fake


class Keys:
    limited = ""  # tenant "lim": one stream at a time
    restricted = ""  # may use "other-model" only
    other = ""  # tenant "other"


async def _provision(p: Pipeline, nats_url: str) -> None:
    nc = await nats.connect(nats_url)
    try:
        js = nc.jetstream()
        kv = await ensure_keys_bucket(js, p.config)
        Keys.limited, _ = await create_key(kv, "lim")
        Keys.restricted, _ = await create_key(kv, "res", models=["other-model"])
        Keys.other, _ = await create_key(kv, "other")
        await set_policy(await ensure_policies_bucket(js, p.config),
                         Policy(tenant="lim", concurrency=1))
    finally:
        await nc.close()


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory: pytest.TempPathFactory, module_nats_url: str,
             module_redis_url: str, backend: FakeBackend,
             big: FakeBackend) -> Iterator[Pipeline]:
    p = Pipeline(tmp_path_factory.mktemp("grpc"), module_nats_url, module_redis_url, overrides={
        "nats": {"subject_prefix": "g" + uuid.uuid4().hex[:8]},
        "edge": {"grpc_port": free_port(), "slow_client_timeout": 30.0},
        "grpc": {"max_concurrent": 3, "max_metadata_bytes": 4096},
        "models": [{"name": "fake", "backend": "openai", "base_url": backend.base_url,
                    "max_streams": 64},
                   {"name": "big", "backend": "openai", "base_url": big.base_url,
                    "max_streams": 4},
                   {"name": "tidegate-sim", "aliases": ["sim"],
                    "simulator": {"ttft": 0.01, "tokens_per_second": 400.0, "length": 32}}],
    })
    asyncio.run(_provision(p, module_nats_url))
    try:
        p.start()
        yield p
    finally:
        p.stop()


def target(p: Pipeline) -> str:
    return f"127.0.0.1:{p.config.edge.grpc_port}"


@pytest.fixture
async def stub(pipeline: Pipeline) -> AsyncIterator[pb_grpc.GatewayStub]:
    async with grpc.aio.insecure_channel(target(pipeline)) as channel:
        yield pb_grpc.GatewayStub(channel)


def auth(key: str | None = DEV_KEY) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {key}"),) if key else ()


def request(body: dict[str, Any], route: int = CHAT, **fields: Any) -> pb.GenerateRequest:
    return pb.GenerateRequest(route=route, body=json.dumps(body).encode(), **fields)


def chat(marker: str, **extra: Any) -> dict[str, Any]:
    return {"model": "fake", "stream": True,
            "messages": [{"role": "user", "content": marker}], **extra}


async def generate(stub: pb_grpc.GatewayStub, req: pb.GenerateRequest,
                   key: str | None = DEV_KEY, **kwargs: Any) -> list[pb.GenerateResponse]:
    return [m async for m in stub.Generate(req, metadata=auth(key), **kwargs)]


def normalise(data: bytes, request_id: str) -> bytes:
    # Each request has its own id and clock second; everything else is equal.
    return re.sub(rb'"created":\d+', b'"created":0', data.replace(request_id.encode(), b"RID"))


async def sse_body(p: Pipeline, path: str, body: dict[str, Any]) -> tuple[bytes, str]:
    async with aiohttp.ClientSession() as session, session.post(
            f"{p.base_url}{path}", json=body,
            headers={"Authorization": f"Bearer {DEV_KEY}"}) as resp:
        assert resp.status == 200
        return await resp.read(), resp.headers["x-request-id"]


async def test_stream_is_byte_exact_against_sse(pipeline: Pipeline,
                                                stub: pb_grpc.GatewayStub) -> None:
    body = {"model": "sim", "max_tokens": 24, "seed": 7, "stream": True,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": "bytes"}]}
    sse, sse_rid = await sse_body(pipeline, "/chat/completions", body)
    assert sse.endswith(b"data: [DONE]\n\n")

    messages = await generate(stub, request(body))
    kinds = [m.WhichOneof("event") for m in messages]
    assert kinds[0] == "accepted", kinds
    assert kinds[-1] == "done", kinds
    assert set(kinds[1:-1]) == {"chunk"}, kinds
    rid = messages[0].accepted.request_id
    assert len(rid) >= 24
    data = b"".join(m.chunk.data for m in messages if m.HasField("chunk"))
    # The backend's bytes as SSE has them, [DONE] aside: never re-encoded.
    assert normalise(data, rid) + b"data: [DONE]\n\n" == normalise(sse, sse_rid)
    usage = messages[-1].done.usage
    assert usage.completion_tokens == 24
    assert usage.prompt_tokens > 0


@pytest.mark.parametrize(("route", "path", "body"), [
    (pb.ROUTE_COMPLETIONS, "/completions",
     {"model": "sim", "prompt": "hi", "max_tokens": 5, "seed": 3, "stream": True}),
    (pb.ROUTE_RESPONSES, "/responses",
     {"model": "sim", "input": "hi", "max_output_tokens": 5, "stream": True}),
    (pb.ROUTE_CHAT_COMPLETIONS, "/chat/completions",
     {"model": "sim", "max_tokens": 5, "seed": 3,
      "messages": [{"role": "user", "content": "whole"}]}),
])
async def test_each_route(pipeline: Pipeline, stub: pb_grpc.GatewayStub, route: int, path: str,
                          body: dict[str, Any]) -> None:
    sse, sse_rid = await sse_body(pipeline, path, body)
    messages = await generate(stub, request(body, route=route))
    assert messages[-1].WhichOneof("event") == "done"
    rid = messages[0].accepted.request_id
    data = b"".join(m.chunk.data for m in messages if m.HasField("chunk"))
    if body.get("stream"):
        assert data.startswith((b"data: ", b"event: "))
        if route == pb.ROUTE_COMPLETIONS:
            assert normalise(data, rid) + b"data: [DONE]\n\n" == normalise(sse, sse_rid)
    else:
        # A non-streaming request: one chunk, the JSON body.
        assert sum(m.HasField("chunk") for m in messages) == 1
        assert json.loads(data)["object"] == "chat.completion"
        assert normalise(data, rid) == normalise(sse, sse_rid)


async def test_embeddings(stub: pb_grpc.GatewayStub) -> None:
    messages = await generate(stub, request({"model": "fake", "input": ["a", "b"]},
                                            route=pb.ROUTE_EMBEDDINGS))
    data = b"".join(m.chunk.data for m in messages if m.HasField("chunk"))
    assert len(json.loads(data)["data"]) == 2
    assert messages[-1].WhichOneof("event") == "done"


async def test_typed_model_fills_the_body_and_must_agree(stub: pb_grpc.GatewayStub) -> None:
    body = {"max_tokens": 3, "messages": [{"role": "user", "content": "typed"}]}
    messages = await generate(stub, request(body, model="sim"))
    assert messages[-1].done.usage.completion_tokens == 3
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await generate(stub, request({**body, "model": "fake"}, model="sim"))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert json.loads(err.value.details())["error"]["code"] == "model_mismatch"


async def http_error(p: Pipeline, path: str, raw: bytes, key: str | None) -> tuple[int, Any]:
    status, data = await asyncio.to_thread(p.post, path, None, raw=raw, key=key)
    return status, json.loads(data)


@pytest.mark.parametrize(("case", "route", "path", "raw", "key", "code"), [
    ("no key", CHAT, "/v1/chat/completions", b'{"model": "sim", "messages": []}', None,
     grpc.StatusCode.UNAUTHENTICATED),
    ("bad key", CHAT, "/v1/chat/completions", b'{"model": "sim", "messages": []}', "sk-nope",
     grpc.StatusCode.UNAUTHENTICATED),
    ("bad json", CHAT, "/v1/chat/completions", b'{"model": "sim", ', DEV_KEY,
     grpc.StatusCode.INVALID_ARGUMENT),
    ("not an object", CHAT, "/v1/chat/completions", b"[1, 2]", DEV_KEY,
     grpc.StatusCode.INVALID_ARGUMENT),
    ("too deep", CHAT, "/v1/chat/completions", b'{"a": ' + b"[" * 200 + b"]" * 200 + b"}",
     DEV_KEY, grpc.StatusCode.INVALID_ARGUMENT),
    ("unknown model", CHAT, "/v1/chat/completions",
     b'{"model": "no-such-model", "messages": [{"role": "user", "content": "x"}]}', DEV_KEY,
     grpc.StatusCode.NOT_FOUND),
    ("not allowed: as unknown", CHAT, "/v1/chat/completions",
     b'{"model": "sim", "messages": [{"role": "user", "content": "x"}]}', "restricted",
     grpc.StatusCode.NOT_FOUND),
    ("bad field", pb.ROUTE_EMBEDDINGS, "/v1/embeddings", b'{"model": "fake", "input": 5}',
     DEV_KEY, grpc.StatusCode.INVALID_ARGUMENT),
])
async def test_errors_are_status_codes_with_the_openai_error(
        pipeline: Pipeline, stub: pb_grpc.GatewayStub, case: str, route: int, path: str,
        raw: bytes, key: str | None, code: grpc.StatusCode) -> None:
    if key == "restricted":
        key = Keys.restricted
    status, expected = await http_error(pipeline, path, raw, key)
    assert status >= 400, case
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await generate(stub, pb.GenerateRequest(route=route, body=raw), key=key)
    assert err.value.code() == code, (case, err.value)
    # The details are the HTTP route's error body, field for field.
    assert json.loads(err.value.details()) == expected, case


async def test_unknown_route_is_invalid_argument(stub: pb_grpc.GatewayStub) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await generate(stub, request(chat("route"), route=0))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert json.loads(err.value.details())["error"]["code"] == "unknown_route"
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await generate(stub, request(chat("route"), route=99))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_429_is_resource_exhausted_with_retry_info(
        pipeline: Pipeline, stub: pb_grpc.GatewayStub, backend: FakeBackend) -> None:
    marker = f"hold-{uuid.uuid4().hex}"
    first = stub.Generate(request(chat(marker, max_tokens=100000)), metadata=auth(Keys.limited))
    async for m in first:
        if m.HasField("chunk"):
            break
    try:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await generate(stub, request(chat("second", max_tokens=5)), key=Keys.limited)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        error = json.loads(err.value.details())["error"]
        assert error["code"] == "rate_limit_concurrency"
        assert error["type"] == "rate_limit_error"
        trailers = dict(err.value.trailing_metadata() or ())
        assert "x-ratelimit-limit-requests" in trailers or "retry-after" in trailers, trailers
    finally:
        first.cancel()
    assert await wait_for(lambda: any(r.closed_at for r in record_for(backend, marker)), 30.0)


async def test_cancel_closes_the_backend_call(pipeline: Pipeline, stub: pb_grpc.GatewayStub,
                                              backend: FakeBackend) -> None:
    marker = f"cancel-{uuid.uuid4().hex}"
    call = stub.Generate(request(chat(marker, max_tokens=100000)), metadata=auth())
    chunks = 0
    async for m in call:
        chunks += m.HasField("chunk")
        if chunks == 5:
            break
    cancelled_at = time.monotonic()
    call.cancel()
    assert await wait_for(lambda: any(r.closed_at for r in record_for(backend, marker)), 30.0)
    record = record_for(backend, marker)[0]
    assert record.closed_at is not None
    assert not record.completed
    assert record.closed_at >= cancelled_at


async def test_deadline_exceeded_closes_the_backend_call(
        pipeline: Pipeline, stub: pb_grpc.GatewayStub, backend: FakeBackend) -> None:
    marker = f"deadline-{uuid.uuid4().hex}"
    started = time.monotonic()
    chunks = 0

    async def read() -> None:
        nonlocal chunks
        async for m in stub.Generate(request(chat(marker, max_tokens=100000)),
                                     metadata=auth(), timeout=3.0):
            chunks += m.HasField("chunk")

    with pytest.raises(grpc.aio.AioRpcError) as err:
        await read()
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert chunks > 0  # it was streaming when the deadline passed
    assert await wait_for(lambda: any(r.closed_at for r in record_for(backend, marker)), 30.0)
    record = record_for(backend, marker)[0]
    assert not record.completed
    assert record.closed_at is not None
    assert record.closed_at >= started + 2.0  # the deadline ended it, nothing earlier


async def test_deadline_before_any_output(pipeline: Pipeline,
                                          stub: pb_grpc.GatewayStub) -> None:
    """A deadline that passes before the first output (the simulator's first
    token comes after it) ends the call as well, and the edge serves on."""
    body = {"model": "sim", "max_tokens": 3, "messages": [{"role": "user", "content": "x"}]}
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await generate(stub, request(body), timeout=0.001)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    # The edge is fine afterwards.
    messages = await generate(stub, request(body), timeout=30.0)
    assert messages[-1].done.usage.completion_tokens == 3


async def test_a_slow_reader_slows_its_backend(pipeline: Pipeline, big: FakeBackend) -> None:
    """HTTP/2 flow control per stream: a client that stops reading stops the
    edge's writes, so the acks, so the worker, so the backend; reading again
    lets it go on. (No BDP probing on the client: its window stays 64 KiB.)"""
    marker = f"slow-{uuid.uuid4().hex}"
    total = 50_000 * 4096
    async with grpc.aio.insecure_channel(target(pipeline),
                                         options=[("grpc.http2.bdp_probe", 0)]) as channel:
        call = pb_grpc.GatewayStub(channel).Generate(
            request({"model": "big", "stream": True, "max_tokens": 50_000,
                     "messages": [{"role": "user", "content": marker}]}), metadata=auth())
        try:
            got = 0
            async for m in call:
                got += m.HasField("chunk")
                if got == 3:
                    break
            assert await wait_for(lambda: bool(record_for(big, marker)), 10.0)
            record = record_for(big, marker)[0]
            await asyncio.sleep(5)  # the client reads nothing
            written = record.bytes_written
            await asyncio.sleep(2)
            assert record.bytes_written - written < 1 << 20, "backend still writing freely"
            # Window (64 KiB) + HTTP/2 windows + kernel buffers of four loopback legs.
            assert written < 24 << 20, f"backend wrote {written} bytes: not pushed back"
            assert written < total / 8
            async for m in call:  # reading again: the backend goes on
                got += m.HasField("chunk")
                if record.bytes_written > written + (4 << 20):
                    break
            assert record.bytes_written > written + (4 << 20)
        finally:
            call.cancel()


async def test_health_follows_readiness_and_reflection_lists_the_services(
        pipeline: Pipeline) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    async with grpc.aio.insecure_channel(target(pipeline)) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "tidegate.v1.Gateway"):
            answer = await health.Check(health_pb2.HealthCheckRequest(service=service))
            assert answer.status == health_pb2.HealthCheckResponse.SERVING, service

    def services() -> list[str]:
        from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
            ProtoReflectionDescriptorDatabase,
        )
        with grpc.insecure_channel(target(pipeline)) as channel:
            return list(ProtoReflectionDescriptorDatabase(channel).get_services())

    listed = await asyncio.to_thread(services)
    assert "tidegate.v1.Gateway" in listed
    assert "grpc.health.v1.Health" in listed


def test_server_options_follow_the_config() -> None:
    from edge.grpc_server import server_options
    from tidegate import config as tgconfig

    class _State:
        config = tgconfig.from_dict({"grpc": {
            "keepalive_time": 7, "keepalive_timeout": 3, "min_ping_interval": 2,
            "max_connection_age": 600, "max_connection_idle": 60,
            "max_concurrent_streams": 9, "max_metadata_bytes": 2048}})

    options = dict(server_options(_State()))  # type: ignore[arg-type]
    assert options["grpc.keepalive_time_ms"] == 7000
    assert options["grpc.keepalive_timeout_ms"] == 3000
    assert options["grpc.http2.min_recv_ping_interval_without_data_ms"] == 2000
    assert options["grpc.max_connection_age_ms"] == 600_000
    assert options["grpc.max_connection_age_grace_ms"] == 30_000  # edge.shutdown_timeout
    assert options["grpc.max_connection_idle_ms"] == 60_000
    assert options["grpc.max_concurrent_streams"] == 9
    assert options["grpc.max_metadata_size"] == 2048
    assert options["grpc.so_reuseport"] == 0
    # edge.max_body_bytes (32 MiB by default) and room for the envelope
    assert options["grpc.max_receive_message_length"] == (32 << 20) + 4096


def test_the_docs_python_example_runs(pipeline: Pipeline) -> None:
    doc = (Path(__file__).resolve().parents[1] / "docs" / "grpc.md").read_text()
    example = doc.split("```python\n", 1)[1].split("```", 1)[0]
    code = example.replace("127.0.0.1:50051", target(pipeline)).replace("sk-...", DEV_KEY)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert "completion_tokens: 32" in done.stdout, done.stdout  # the simulator's length
