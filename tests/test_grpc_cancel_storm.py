"""A storm of gRPC cancels leaves nothing running (docs/security.md).

grpcio cancels a call's handler task when its client cancels (or its
deadline passes), at whatever step the handler is: validating, publishing
the request, waiting for the stream's head, streaming. Every call that
published a request must stop its job upstream at once, never leave it to
the worker's ``session.ack_timeout`` (here far longer than the tests wait).
The unit test pins the step that lost cancels (a cancel while the publish is
awaited); the pipeline tests storm Generate and Session calls against the
real edge, dispatcher and worker, nats-server and redis-server, and the fake
backend, which records when each of its calls ended.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import re
import uuid
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import grpc
import nats
import pytest

from bench.fake_backend import FakeBackend
from edge import grpc_calls, instrument
from edge.auth import Principal
from edge.grpc_calls import Generation, run_generation
from edge.relay import RelayContext
from edge.session import SessionTable
from fleet.run.servers import free_port
from tests.pipeline import Pipeline, tenant_keys, threaded_fake_backend, wait_for
from tests.test_relay_direct import RecordingPublisher
from tidegate import config as tgconfig
from tidegate.apis.chat import DIALECT as CHAT
from tidegate.control.policies import Policy, ensure_policies_bucket, set_policy
from tidegate.control.tenants import TenantTable
from tidegate.telemetry import telemetry
from tidegate.wire import gateway_pb2 as pb
from tidegate.wire import gateway_pb2_grpc as pb_grpc
from tidegate.wire.protocol import Request

ACK_TIMEOUT = 300.0  # a job whose cancel was lost holds its slot this long
SETTLE = 30.0  # what "promptly" allows on a loaded machine: far below ACK_TIMEOUT
CALLS = 300
AT_ONCE = 24  # calls open at a time
LIMIT = 32  # the storm tenant's concurrency policy
SESSIONS = 60  # Session calls ...
GENERATIONS = 4  # ... each with this many generations


# -- the racy step, with a fake broker ----------------------------------------


class _Sink:
    def __init__(self) -> None:
        self.sent: list[pb.GenerateResponse] = []

    async def send(self, message: pb.GenerateResponse) -> None:
        self.sent.append(message)


def _state(publisher: RecordingPublisher) -> Any:
    config = tgconfig.from_dict({
        "models": [{"name": "m", "backend": "openai", "base_url": "http://127.0.0.1:9/v1"}]})
    return SimpleNamespace(config=config, models={m.name: m for m in config.models},
                           edge_id="e1", tenants=TenantTable(),
                           sessions=SessionTable("tg.out.e1."),
                           relay=RelayContext(config, publisher))


async def test_a_cancel_while_the_request_is_published_stops_it_upstream(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The publish may have landed (JetStream stored it, its PubAck not yet
    read) when the call is cancelled: the request's tombstone must follow, or
    a worker runs it for nobody until its ack timeout."""
    landed = asyncio.Event()
    published: list[str] = []

    async def publish_request(state: Any, request: Request, carrier: Any) -> Any:
        published.append(request.id)
        landed.set()
        await asyncio.Event().wait()  # the PubAck never comes back in time

    monkeypatch.setattr(grpc_calls, "publish_request", publish_request)
    publisher = RecordingPublisher()
    state = _state(publisher)
    req = pb.GenerateRequest(route=pb.ROUTE_CHAT_COMPLETIONS, body=json.dumps(
        {"model": "m", "stream": True, "messages": [{"role": "user", "content": "x"}]}).encode())
    sink = _Sink()
    task = asyncio.create_task(run_generation(
        state, Principal("t", "", "k1"), req, {}, sink, Generation(""),
        instrument.RequestTelemetry(telemetry.get(), {}, CHAT.api), None))
    await asyncio.wait_for(landed.wait(), 5.0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert publisher.tombstones == [(published[0], "client_disconnected")]
    assert len(state.sessions) == 0
    assert sink.sent == []


# -- the storm, against the real pipeline -------------------------------------


@pytest.fixture(scope="module")
def backend() -> Iterator[FakeBackend]:
    # No natural end: a job runs until its cancel (or its ack timeout).
    with threaded_fake_backend(models=["fake"], ttft=0.005, itl=0.01, tokens=10**9) as fake:
        yield fake


class Keys:
    storm = ""


async def _provision(p: Pipeline) -> None:
    (Keys.storm,) = await tenant_keys(p, "storm")
    nc = await nats.connect(p.config.nats.url)
    try:
        await set_policy(await ensure_policies_bucket(nc.jetstream(), p.config),
                         Policy(tenant="storm", concurrency=LIMIT))
    finally:
        await nc.close()


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory: pytest.TempPathFactory, module_nats_url: str,
             module_redis_url: str, backend: FakeBackend) -> Iterator[Pipeline]:
    p = Pipeline(tmp_path_factory.mktemp("grpcstorm"), module_nats_url, module_redis_url,
                 metrics=True, overrides={
                     "nats": {"subject_prefix": "c" + uuid.uuid4().hex[:8]},
                     "session": {"ack_timeout": ACK_TIMEOUT},
                     "edge": {"grpc_port": free_port()},
                     "models": [{"name": "fake", "backend": "openai",
                                 "base_url": backend.base_url, "max_streams": 64}]})
    asyncio.run(_provision(p))
    try:
        p.start()
        yield p
    finally:
        p.stop()


def _request(marker: str) -> pb.GenerateRequest:
    return pb.GenerateRequest(route=pb.ROUTE_CHAT_COMPLETIONS, body=json.dumps(
        {"model": "fake", "stream": True,
         "messages": [{"role": "user", "content": marker}]}).encode())


async def _until(call: Any, chunks: int) -> None:
    """Read until the call's ``chunks``-th chunk (0: its first message)."""
    seen = 0
    async for message in call:
        seen += message.HasField("chunk")
        if seen >= chunks:
            return


def _slots_used(p: Pipeline) -> float:
    text = p.scrape("worker0")
    used = [float(m.group(1)) for m in re.finditer(
        r'^tidegate_worker_slots\{[^}]*state="used"[^}]*\} (\S+)$', text, re.M)]
    assert used, "the worker reports no tidegate_worker_slots"
    return sum(used)


def _open(backend: FakeBackend, prefix: str) -> list[int]:
    """The fake backend's calls of this storm that still run."""
    return [r.id for r in list(backend.records)
            if r.finished_at is None and prefix in json.dumps(r.body.get("messages"))]


async def test_a_storm_of_cancels_leaves_nothing_running(pipeline: Pipeline,
                                                         backend: FakeBackend) -> None:
    prefix = f"storm-{uuid.uuid4().hex}"
    rng = random.Random(prefix)
    metadata = (("authorization", f"Bearer {Keys.storm}"),)
    gate = asyncio.Semaphore(AT_ONCE)
    moments: dict[str, int] = {}

    async def one(stub: Any, i: int) -> None:
        moment = i % 5
        async with gate:
            call = stub.Generate(_request(f"{prefix}-{i}"), metadata=metadata)
            try:
                if moment == 1:  # around validation and the publish
                    await asyncio.sleep(rng.uniform(0.0, 0.01))
                elif moment == 2:  # before the stream's head: Accepted is the first message
                    await _until(call, 0)
                elif moment == 3:
                    await _until(call, 1)
                elif moment == 4:
                    await _until(call, rng.randint(2, 30))
            except grpc.aio.AioRpcError as error:  # 429 at a busy moment: a storm's answer
                moments[error.code().name] = moments.get(error.code().name, 0) + 1
            finally:
                call.cancel()

    reached = await _storm(pipeline, backend, prefix, CALLS, one)
    assert reached >= CALLS // 5, (reached, moments)  # the storm reached the backend
    await _settled(pipeline, backend, prefix, reached, metadata)


async def _storm(pipeline: Pipeline, backend: FakeBackend, prefix: str, count: int,
                 one: Any) -> int:
    """``one(stub, i)`` for i below ``count``, all at once on one channel;
    how many of the storm's requests reached the backend."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{pipeline.config.edge.grpc_port}") as ch:
        stub = pb_grpc.GatewayStub(ch)  # type: ignore[no-untyped-call]
        async with asyncio.TaskGroup() as tg:
            for i in range(count):
                tg.create_task(one(stub, i))
    return sum(1 for r in list(backend.records) if prefix in json.dumps(r.body.get("messages")))


async def _settled(pipeline: Pipeline, backend: FakeBackend, prefix: str, reached: int,
                   metadata: tuple[tuple[str, str], ...]) -> None:
    """Every job ends at its cancel, not at its ack timeout: the backend calls
    close, the worker's slots and the tenant's leases come back."""
    assert await wait_for(lambda: not _open(backend, prefix), SETTLE, step=0.2), (
        f"{len(_open(backend, prefix))} of {reached} backend calls still open "
        f"{SETTLE:g}s after the storm")
    assert await wait_for(lambda: _slots_used(pipeline) == 0, SETTLE, step=0.2)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{pipeline.config.edge.grpc_port}") as ch:
        stub = pb_grpc.GatewayStub(ch)  # type: ignore[no-untyped-call]
        calls = [stub.Generate(_request(f"{prefix}-after-{i}"), metadata=metadata)
                 for i in range(LIMIT)]
        try:
            # All LIMIT streams at once: no lease of the storm is still held.
            await asyncio.gather(*(_until(call, 1) for call in calls))
        finally:
            for call in calls:
                with contextlib.suppress(Exception):
                    call.cancel()


async def test_a_storm_of_session_cancels_leaves_nothing_running(
        pipeline: Pipeline, backend: FakeBackend) -> None:
    """Session calls: generations cancelled by message, or by the call's end,
    at varied moments."""
    prefix = f"session-storm-{uuid.uuid4().hex}"
    rng = random.Random(prefix)
    metadata = (("authorization", f"Bearer {Keys.storm}"),)
    gate = asyncio.Semaphore(AT_ONCE // GENERATIONS)

    async def one(stub: Any, i: int) -> None:
        async with gate, asyncio.timeout(SETTLE):
            call = stub.Session(metadata=metadata)
            ids = [f"g{g}" for g in range(GENERATIONS)]
            ended: set[str] = set()  # a 429 at a busy moment ends one at once

            async def read(messages: int) -> None:
                for _ in range(messages):
                    if len(ended) == len(ids):
                        return
                    message = await call.read()
                    assert message is not grpc.aio.EOF, ended
                    if message.WhichOneof("event") in ("cancelled", "error", "done"):
                        ended.add(message.id)

            try:
                for gid in ids:
                    await call.write(pb.SessionRequest(id=gid, generate=_request(
                        f"{prefix}-{i}-{gid}")))
                moment = i % 3
                if moment == 1:
                    await asyncio.sleep(rng.uniform(0.0, 0.01))
                elif moment == 2:
                    await read(rng.randint(1, 12))
                if i % 2:  # by message: each generation ends with Cancelled
                    for gid in ids:
                        if gid not in ended:
                            await call.write(pb.SessionRequest(id=gid, cancel=pb.Cancel()))
                    await read(10**6)
            finally:
                call.cancel()  # else by the call's end

    reached = await _storm(pipeline, backend, prefix, SESSIONS, one)
    assert reached >= SESSIONS // 6, reached  # the storm reached the backend
    await _settled(pipeline, backend, prefix, reached, metadata)
