"""gRPC ``Session`` (many generations on one call), resume across edges,
drain on SIGTERM and hostile inputs, against real servers: two edges (each
with its gRPC port), a dispatcher and a worker, a real nats-server and
redis-server, and the fake OpenAI backend, which records closes."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest

from bench.fake_backend import FakeBackend
from fleet.run.servers import free_port, http_ok
from tests.pipeline import DEV_KEY, Pipeline, record_for, threaded_fake_backend, wait_for
from tests.test_ws_resume import tenant_key
from tidegate.telemetry.observability import METRICS_PORT_ENV
from tidegate.wire import gateway_pb2 as pb
from tidegate.wire import gateway_pb2_grpc as pb_grpc

pytestmark = pytest.mark.pipeline

AUTH = (("authorization", f"Bearer {DEV_KEY}"),)


@pytest.fixture(scope="module")
def backend() -> Iterator[FakeBackend]:
    with threaded_fake_backend(models=["fake"], ttft=0.01, itl=0.01, tokens=10**9,
                               keep_output=True) as fake:
        yield fake


def _pipeline(workdir: Path, nats_url: str, redis_url: str, backend: FakeBackend) -> Pipeline:
    """Two edges; edge 1 gets a gRPC port of its own through the environment."""
    p = Pipeline(workdir, nats_url, redis_url, edges=2, overrides={
        "nats": {"subject_prefix": "s" + uuid.uuid4().hex[:8]},
        "session": {"heartbeat_interval": 1.0, "worker_lost_after": 4, "ack_timeout": 6.0},
        "worker": {"ack_wait": 2.0, "shutdown_timeout": 3.0},
        "edge": {"shutdown_timeout": 4.0, "slow_client_timeout": 4.0,
                 "grpc_port": free_port()},
        "resume": {"attach_interval": 0.5},
        "grpc": {"max_concurrent": 3, "max_metadata_bytes": 4096},
        "models": [{"name": "fake", "backend": "openai", "base_url": backend.base_url,
                    "max_streams": 64},
                   {"name": "tidegate-sim", "aliases": ["sim"],
                    "simulator": {"ttft": 0.01, "tokens_per_second": 400.0, "length": 32}}]})
    p.grpc_ports = [p.config.edge.grpc_port, free_port()]  # type: ignore[attr-defined]
    url = p.edge_urls[1]
    p.extra_edges = [p._process(
        "edge", "edge1", ready=lambda: http_ok(f"{url}/readyz"),
        args=["--port", str(p.edge_ports[1])],
        extra_env={METRICS_PORT_ENV: str(p.metrics_ports["edge1"]),
                   "TIDEGATE__EDGE__GRPC_PORT": str(p.grpc_ports[1])})]  # type: ignore[attr-defined]
    return p


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory: pytest.TempPathFactory, module_nats_url: str,
             module_redis_url: str, backend: FakeBackend) -> Iterator[Pipeline]:
    p = _pipeline(tmp_path_factory.mktemp("grpcsession"), module_nats_url, module_redis_url,
                  backend)
    try:
        p.start()
        yield p
    finally:
        p.stop()


def target(p: Pipeline, edge: int = 0) -> str:
    return f"127.0.0.1:{p.grpc_ports[edge]}"  # type: ignore[attr-defined]


@contextlib.asynccontextmanager
async def stub_for(p: Pipeline, edge: int = 0) -> AsyncIterator[pb_grpc.GatewayStub]:
    async with grpc.aio.insecure_channel(target(p, edge)) as channel:
        yield pb_grpc.GatewayStub(channel)


def generate(gid: str, body: dict[str, Any], route: int = pb.ROUTE_CHAT_COMPLETIONS,
             **fields: Any) -> pb.SessionRequest:
    return pb.SessionRequest(id=gid, generate=pb.GenerateRequest(
        route=route, body=json.dumps(body).encode(), **fields))


def chat(marker: str, tokens: int, **extra: Any) -> dict[str, Any]:
    return {"model": "fake", "stream": True, "max_tokens": tokens,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": marker}], **extra}


class SessionClient:
    """A Session call: send messages, read each generation's messages."""

    def __init__(self, stub: pb_grpc.GatewayStub, key: str = DEV_KEY) -> None:
        self.call = stub.Session(metadata=(("authorization", f"Bearer {key}"),))
        self.got: dict[str, list[pb.GenerateResponse]] = {}
        self.order: list[str] = []

    async def send(self, msg: pb.SessionRequest) -> None:
        await self.call.write(msg)

    async def next(self, within: float = 30.0) -> pb.GenerateResponse:
        msg = await asyncio.wait_for(self.call.read(), within)
        assert msg is not grpc.aio.EOF, "the call ended"
        self.got.setdefault(msg.id, []).append(msg)
        self.order.append(msg.id)
        return msg  # type: ignore[no-any-return]

    async def until_end(self, *ids: str, within: float = 60.0) -> None:
        ends = ("done", "error", "cancelled", "reconnect")
        # A generation that ended while the test read for another counts.
        open_ = {gid for gid in ids if not (self.kinds(gid) and self.kinds(gid)[-1] in ends)}
        deadline = time.monotonic() + within
        while open_:
            try:
                msg = await self.next(deadline - time.monotonic())
            except TimeoutError:
                seen = {gid: self.kinds(gid)[-3:] for gid in self.got}
                raise AssertionError(f"{open_} did not end; last messages: {seen}") from None
            if msg.id in open_ and msg.WhichOneof("event") in ends:
                open_.discard(msg.id)

    def kinds(self, gid: str) -> list[str]:
        return [m.WhichOneof("event") for m in self.got.get(gid, [])]

    def data(self, gid: str) -> bytes:
        return b"".join(m.chunk.data for m in self.got.get(gid, []) if m.HasField("chunk"))


def events(messages: list[pb.GenerateResponse]) -> int:
    """How many SSE events the chunks of ``messages`` carry."""
    data = b"".join(m.chunk.data for m in messages if m.HasField("chunk"))
    return len([e for e in data.split(b"\n\n") if e])


def normalise(data: bytes, request_id: str) -> bytes:
    return re.sub(rb'"created":\d+', b'"created":0', data.replace(request_id.encode(), b"RID"))


async def test_two_generations_interleave_byte_exact_and_one_is_cancelled(
        pipeline: Pipeline, backend: FakeBackend) -> None:
    body = {"model": "sim", "max_tokens": 24, "seed": 7, "stream": True,
            "messages": [{"role": "user", "content": "interleave"}]}
    async with aiohttp.ClientSession() as http, http.post(
            f"{pipeline.base_url}/chat/completions", json=body,
            headers={"Authorization": f"Bearer {DEV_KEY}"}) as resp:
        sse, sse_rid = await resp.read(), resp.headers["x-request-id"]
    cancel_marker = f"cancel-{uuid.uuid4().hex}"
    async with stub_for(pipeline) as stub:
        s = SessionClient(stub)
        await s.send(generate("long", chat(cancel_marker, 100000)))
        await s.send(generate("a", body))
        await s.send(generate("b", body))
        while s.kinds("long").count("chunk") < 5:
            await s.next()
        cancelled_at = time.monotonic()
        await s.send(pb.SessionRequest(id="long", cancel=pb.Cancel()))
        await s.until_end("long", "a", "b")
        # The call is still good for more.
        await s.send(generate("c", {**body, "max_tokens": 2}))
        await s.until_end("c")
        await s.call.done_writing()
        assert await asyncio.wait_for(s.call.read(), 30) is grpc.aio.EOF
        assert await s.call.code() == grpc.StatusCode.OK

    assert s.kinds("long")[-1] == "cancelled"
    for gid in ("a", "b"):
        kinds = s.kinds(gid)
        assert kinds[0] == "accepted", kinds
        assert kinds[-1] == "done", kinds
        rid = s.got[gid][0].accepted.request_id
        assert normalise(s.data(gid), rid) + b"data: [DONE]\n\n" == normalise(sse, sse_rid)
        assert s.got[gid][-1].done.usage.completion_tokens == 24
    assert s.got["c"][-1].done.usage.completion_tokens == 2
    # a and b ran at once: their chunks interleave.
    chunks = [gid for gid in s.order if gid in ("a", "b")]
    assert chunks.index("b") < len(chunks) - 1 - chunks[::-1].index("a"), chunks
    assert await wait_for(lambda: any(r.closed_at for r in record_for(backend, cancel_marker)),
                          30.0)
    record = record_for(backend, cancel_marker)[0]
    assert not record.completed
    assert record.closed_at is not None
    assert record.closed_at >= cancelled_at


async def test_resume_on_another_edge_and_another_tenant_is_refused(
        pipeline: Pipeline) -> None:
    marker = f"resume-{uuid.uuid4().hex}"
    async with stub_for(pipeline, 0) as stub:
        s = SessionClient(stub)
        await s.send(generate("g", chat(marker, 400), resumable=True))
        while s.kinds("g").count("chunk") < 5:
            await s.next()
        s.call.cancel()  # the client leaves; a resumable stream generates on
    first = s.got["g"]
    assert first[0].accepted.resumable
    rid = first[0].accepted.request_id
    seqs = [m.chunk.seq for m in first if m.HasField("chunk")]
    # seq is the number of the last event in a chunk (a chunk may carry several).
    assert seqs == sorted(set(seqs))
    assert events(first) == seqs[-1]

    other = await tenant_key(pipeline, "someone-else")
    async with stub_for(pipeline, 1) as stub:
        intruder = SessionClient(stub, other)
        await intruder.send(pb.SessionRequest(id="x", resume=pb.Resume(request_id=rid)))
        await intruder.until_end("x")
        error = intruder.got["x"][-1].error
        assert error.code == grpc.StatusCode.NOT_FOUND.value[0]
        assert error.http_status == 404
        # Not "forbidden": another tenant's stream does not exist for it.
        assert json.loads(error.error)["error"]["code"] == "stream_not_found"
        intruder.call.cancel()

        s = SessionClient(stub)
        await s.send(pb.SessionRequest(id="g", resume=pb.Resume(request_id=rid,
                                                                after=seqs[-1])))
        await s.until_end("g")
        s.call.cancel()
    rest = s.got["g"]
    assert rest[0].accepted.request_id == rid
    assert rest[-1].WhichOneof("event") == "done"
    more = [m.chunk.seq for m in rest if m.HasField("chunk")]
    # The log replays one event per chunk, right after the last one seen.
    assert more == list(range(seqs[-1] + 1, seqs[-1] + 1 + len(more)))
    assert rest[-1].done.usage.completion_tokens == 400


async def test_hostile_session_messages_get_errors_and_the_call_survives(
        pipeline: Pipeline) -> None:
    async with stub_for(pipeline) as stub:
        s = SessionClient(stub)

        async def expect(msg: pb.SessionRequest, gid: str, code: str,
                         status: grpc.StatusCode = grpc.StatusCode.INVALID_ARGUMENT) -> None:
            await s.send(msg)
            while True:
                got = await s.next()
                if got.id == gid and got.WhichOneof("event") == "error":
                    break
            assert json.loads(got.error.error)["error"]["code"] == code
            assert got.error.code == status.value[0]

        await expect(pb.SessionRequest(id="", cancel=pb.Cancel()), "", "invalid_id")
        await expect(generate("x" * 129, chat("long id", 1)), "x" * 128, "invalid_id")
        await expect(pb.SessionRequest(id="none"), "none", "invalid_message")
        await expect(pb.SessionRequest(id="ghost", cancel=pb.Cancel()), "ghost", "unknown_id")
        await expect(pb.SessionRequest(id="j", generate=pb.GenerateRequest(
            route=pb.ROUTE_CHAT_COMPLETIONS, body=b'{"model": ')), "j", "invalid_json")
        await expect(pb.SessionRequest(id="r", generate=pb.GenerateRequest(
            route=77, body=b"{}")), "r", "unknown_route")
        await expect(generate("m", {"model": "nope", "messages": [
            {"role": "user", "content": "x"}]}), "m", "model_not_found",
            grpc.StatusCode.NOT_FOUND)
        # A duplicate id while the first runs; then past grpc.max_concurrent (3).
        await s.send(generate("d1", chat("dup", 100000)))
        await expect(generate("d1", chat("dup", 100000)), "d1", "duplicate_id")
        await s.send(generate("d2", chat("dup", 100000)))
        await s.send(generate("d3", chat("dup", 100000)))
        await expect(generate("d4", chat("dup", 100000)), "d4", "too_many_concurrent",
                     grpc.StatusCode.RESOURCE_EXHAUSTED)
        for gid in ("d1", "d2", "d3"):
            await s.send(pb.SessionRequest(id=gid, cancel=pb.Cancel()))
        # Each one's Cancelled, read: not until_end, to which d1 looks ended
        # by the duplicate's error (its "accepted" may come after that error
        # on a busy box, and the test then read on past d1's end).
        while not all("cancelled" in s.kinds(g) for g in ("d1", "d2", "d3")):
            await s.next()
        assert {s.kinds(g)[-1] for g in ("d1", "d2", "d3")} == {"cancelled"}
        # Still alive after all of it.
        await s.send(generate("ok", {"model": "sim", "prompt": "hi", "max_tokens": 3},
                              route=pb.ROUTE_COMPLETIONS))
        await s.until_end("ok")
        assert s.got["ok"][-1].done.usage.completion_tokens == 3
        s.call.cancel()


async def test_hostile_calls(pipeline: Pipeline) -> None:
    body = json.dumps({"model": "sim", "max_tokens": 1,
                       "messages": [{"role": "user", "content": "x"}]}).encode()
    req = pb.GenerateRequest(route=pb.ROUTE_CHAT_COMPLETIONS, body=body)
    async with stub_for(pipeline) as stub:
        async def fails(request: pb.GenerateRequest, metadata: Any) -> grpc.aio.AioRpcError:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await asyncio.wait_for(
                    _drain_call(stub.Generate(request, metadata=metadata)), 30)
            return err.value

        # A message over the limit: refused before it is parsed.
        huge = pb.GenerateRequest(route=pb.ROUTE_CHAT_COMPLETIONS,
                                  body=b" " * (pipeline.config.edge.max_body_bytes + (8 << 10)))
        assert (await fails(huge, AUTH)).code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        # Metadata past grpc.max_metadata_bytes.
        big = (*AUTH, ("x-junk", "a" * 8000))
        assert (await fails(req, big)).code() in (grpc.StatusCode.RESOURCE_EXHAUSTED,
                                                  grpc.StatusCode.INTERNAL,
                                                  grpc.StatusCode.UNAVAILABLE)
        # Two authorization values: never "whichever came last".
        twice = (*AUTH, ("authorization", "Bearer sk-other"))
        error = await fails(req, twice)
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert json.loads(error.details())["error"]["code"] == "duplicate_metadata"
        # Not a Bearer key; a key in the wrong place.
        for metadata in ((("authorization", f"Basic {DEV_KEY}"),),
                         (("x-api-key", DEV_KEY),)):
            assert (await fails(req, metadata)).code() == grpc.StatusCode.UNAUTHENTICATED
        # A Session without a key ends at once.
        call = stub.Session(metadata=())
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await asyncio.wait_for(call.read(), 30)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # The server serves on.
        messages = [m async for m in stub.Generate(req, metadata=AUTH)]
        assert messages[-1].done.usage.completion_tokens == 1


async def _drain_call(call: Any) -> None:
    async for _ in call:
        pass


@pytest.mark.slow
async def test_drain_tells_resumable_generations_to_reconnect(
        tmp_path: Path, module_nats_url: str, module_redis_url: str,
        backend: FakeBackend) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    p = _pipeline(tmp_path, module_nats_url, module_redis_url, backend)
    marker = f"grpcdrain-{uuid.uuid4().hex}"
    try:
        p.start()
        async with grpc.aio.insecure_channel(target(p, 0)) as channel:
            watch = health_pb2_grpc.HealthStub(channel).Watch(
                health_pb2.HealthCheckRequest(service="tidegate.v1.Gateway"))
            first = await asyncio.wait_for(watch.read(), 30)
            assert first.status == health_pb2.HealthCheckResponse.SERVING
            call = pb_grpc.GatewayStub(channel).Generate(pb.GenerateRequest(
                route=pb.ROUTE_CHAT_COMPLETIONS, body=json.dumps(chat(marker, 400)).encode(),
                resumable=True), metadata=AUTH)
            got: list[pb.GenerateResponse] = []
            while sum(m.HasField("chunk") for m in got) < 5:
                got.append(await asyncio.wait_for(call.read(), 30))
            p.edge.terminate()  # SIGTERM edge 0
            terminated = time.monotonic()

            async def read_all() -> None:
                while True:
                    got.append(await asyncio.wait_for(call.read(), 30))

            with pytest.raises(grpc.aio.AioRpcError) as err:
                await read_all()
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert json.loads(err.value.details())["error"]["code"] == "edge_reconnect"
            # At once, not after edge.shutdown_timeout (4 s).
            assert time.monotonic() - terminated < 4.0
            # Health said so to whoever watched.
            statuses = []
            with contextlib.suppress(grpc.aio.AioRpcError, asyncio.TimeoutError):
                while True:
                    update = await asyncio.wait_for(watch.read(), 10)
                    if update is grpc.aio.EOF:
                        break
                    statuses.append(update.status)
            assert health_pb2.HealthCheckResponse.NOT_SERVING in statuses, statuses
        reconnect = got[-1].reconnect
        assert got[-1].HasField("reconnect")
        assert reconnect.request_id == got[0].accepted.request_id
        seqs = [m.chunk.seq for m in got if m.HasField("chunk")]
        assert reconnect.after == seqs[-1] == events(got)
        async with stub_for(p, 1) as stub:
            s = SessionClient(stub)
            await s.send(pb.SessionRequest(id="g", resume=pb.Resume(
                request_id=reconnect.request_id, after=reconnect.after)))
            await s.until_end("g")
            s.call.cancel()
        rest = s.got["g"]
        assert rest[-1].WhichOneof("event") == "done"
        more = [m.chunk.seq for m in rest if m.HasField("chunk")]
        assert more == list(range(seqs[-1] + 1, seqs[-1] + 1 + len(more)))
        assert rest[-1].done.usage.completion_tokens == 400
    finally:
        p.stop()


async def test_a_reader_that_stops_is_dropped_and_its_work_cancelled(
        pipeline: Pipeline, backend: FakeBackend) -> None:
    """A write pending past edge.slow_client_timeout (4 s here) ends the call
    with UNAVAILABLE slow_client, and the backend call is closed."""
    marker = f"stuck-{uuid.uuid4().hex}"
    async with grpc.aio.insecure_channel(target(pipeline),
                                         options=[("grpc.http2.bdp_probe", 0)]) as channel:
        call = pb_grpc.GatewayStub(channel).Generate(pb.GenerateRequest(
            route=pb.ROUTE_CHAT_COMPLETIONS,
            body=json.dumps(chat(marker, 100000)).encode()),
            metadata=AUTH)
        got = 0
        while got < 3:
            got += (await asyncio.wait_for(call.read(), 30)).HasField("chunk")
        stopped = time.monotonic()
        # Read nothing more: the backend is closed once the edge gives up.
        assert await wait_for(lambda: any(r.closed_at for r in record_for(backend, marker)),
                              60.0)
        record = record_for(backend, marker)[0]
        assert not record.completed
        assert record.closed_at is not None
        assert record.closed_at - stopped >= 3.0  # not before the timeout (4 s)

        async def read_all() -> None:
            while True:
                if await asyncio.wait_for(call.read(), 30) is grpc.aio.EOF:
                    return

        with pytest.raises(grpc.aio.AioRpcError) as err:
            await read_all()
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert json.loads(err.value.details())["error"]["code"] == "slow_client"


async def test_a_session_ends_when_its_key_is_revoked(pipeline: Pipeline,
                                                      backend: FakeBackend) -> None:
    """As a WebSocket: a revoke ends the call at once, idle or not, and its
    generations are cancelled upstream."""
    from tests.test_ws_revoke import revoke
    key = await tenant_key(pipeline, "revoked")
    marker = f"revoke-{uuid.uuid4().hex}"
    async with stub_for(pipeline) as stub:
        s = SessionClient(stub, key)
        await s.send(generate("long", chat(marker, 100000)))
        while "chunk" not in s.kinds("long"):
            await s.next()
        await revoke(pipeline, key)

        async def read_all() -> None:
            while True:
                await s.next()

        with pytest.raises(grpc.aio.AioRpcError) as err:
            await read_all()
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert json.loads(err.value.details())["error"]["code"] == "revoked_api_key"
    assert "done" not in s.kinds("long")
    assert await wait_for(lambda: any(r.closed_at for r in record_for(backend, marker)), 30.0)
