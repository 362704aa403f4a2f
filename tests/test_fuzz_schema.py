"""The edge's whole HTTP surface, its WebSocket frames and its gRPC messages,
fuzzed from the OpenAPI description it serves, against a real pipeline
(docs/security.md, "Schema fuzzing").

schemathesis makes requests of every operation of ``GET /openapi.json``, data
that fits the schemas (deep: model names filled in, as a key's holder has
them) and data that does not, with a fixed, derandomized budget per operation
(``TIDEGATE_FUZZ_EXAMPLES``, default 8; the long run in docs/security.md sets
more). Hypothesis sends WebSocket frame sequences, valid and not, on
authenticated sockets (``TIDEGATE_FUZZ_WS_EXAMPLES``, default 50), and gRPC
``Generate`` and ``Session`` calls of drawn messages (``TIDEGATE_FUZZ_GRPC_EXAMPLES``,
default 50 each). Invariants: never a 5xx but a documented overload (503, or
Anthropic's 529, with Retry-After), an error body on every 4xx, a socket that
answers a ping after any frames, never gRPC's INTERNAL, UNKNOWN or DATA_LOSS,
never a traceback in any tier's log, every tier still serving, and no quota
reservation or lease left in Redis once the requests are done.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import urllib.request
import uuid
from collections.abc import Iterator
from typing import Any

import aiohttp
import grpc
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dispatcher.quota import connect as connect_redis
from edge.grpc_calls import ROUTES as GRPC_ROUTES
from edge.openapi import document
from fleet.run.servers import free_port
from tests.pipeline import Pipeline
from tests.test_openapi import _integral
from tidegate import config as tgconfig
from tidegate.apis import WEBSOCKET_PATHS as PATHS
from tidegate.broker import broker
from tidegate.control.keys import create_key, ensure_keys_bucket
from tidegate.control.policies import Policy, ensure_policies_bucket, set_policy
from tidegate.validation.schemas import MODEL_NAME
from tidegate.wire import gateway_pb2 as pb
from tidegate.wire import gateway_pb2_grpc as pb_grpc
from tidegate.wire.ws import MAX_ID_LENGTH

pytestmark = pytest.mark.pipeline

EXAMPLES = int(os.environ.get("TIDEGATE_FUZZ_EXAMPLES", "8"))
WS_EXAMPLES = int(os.environ.get("TIDEGATE_FUZZ_WS_EXAMPLES", "50"))
GRPC_EXAMPLES = int(os.environ.get("TIDEGATE_FUZZ_GRPC_EXAMPLES", "50"))
PREFIX = "fz" + uuid.uuid4().hex[:8]
TENANT = "fuzz"
OVERRIDES: dict[str, Any] = {
    "nats": {"subject_prefix": PREFIX},
    # metrics_public: so /metrics is described and fuzzed too
    "edge": {"metrics_public": True, "grpc_port": free_port()},
    "models": [{"name": "tidegate-sim", "aliases": ["sim"], "resumable": True,
                "max_output_tokens": 4096,
                "simulator": {"ttft": 0.0, "tokens_per_second": 4000.0, "length": 12}}],
}
# The same config the pipeline gets: its description, with the model names a
# key's holder reads from GET /v1/models (the served one has none).
_CONFIG = tgconfig.from_dict({"nats": {"url": "nats://unused"}, **OVERRIDES})
_DOC = document(_CONFIG)
_DOC["components"]["schemas"][MODEL_NAME]["enum"] = sorted(_CONFIG.model_index())
SCHEMA = schemathesis.openapi.from_dict(_DOC)
POSITIVE, NEGATIVE = schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE
# Data that does not fit exists only for an operation that takes some.
CASES = [(method.upper(), path, mode) for path, methods in _DOC["paths"].items()
         for method, op in methods.items()
         for mode in ([POSITIVE, NEGATIVE] if {"parameters", "requestBody"} & set(op)
                      else [POSITIVE])]
OVERLOAD = {503, 529}  # documented: Retry-After, retry elsewhere or later


class Fuzz:
    def __init__(self, pipeline: Pipeline, key: str) -> None:
        self.pipeline, self.key = pipeline, key

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"}


async def _provision(pipeline: Pipeline) -> str:
    """A key whose tenant has a policy on every kind of limit, so each
    admitted request leaves a reservation record and a lease to settle."""
    nc = await broker.connect(pipeline.config.nats, "fuzz-admin")
    try:
        js = broker.jetstream(nc, pipeline.config.nats)
        key, _ = await create_key(await ensure_keys_bucket(js, pipeline.config), TENANT)
        await set_policy(await ensure_policies_bucket(js, pipeline.config),
                         Policy(tenant=TENANT, rpm=1_000_000, tpm=10**12, concurrency=10_000))
        return key
    finally:
        await nc.close()


@pytest.fixture(scope="module")
def fuzz(tmp_path_factory: pytest.TempPathFactory, module_nats_url: str,
         module_redis_url: str) -> Iterator[Fuzz]:
    pipeline = Pipeline(tmp_path_factory.mktemp("fuzz-schema"), module_nats_url,
                        module_redis_url, overrides=OVERRIDES)
    try:
        key = asyncio.run(_provision(pipeline))
        pipeline.start()
        yield Fuzz(pipeline, key)
    finally:
        pipeline.stop()


def _no_traceback(pipeline: Pipeline, what: object) -> None:
    """No traceback in any tier's log since the last call: each test answers
    for its own (the long run goes on past one finding to the next)."""
    for process in pipeline.processes:
        if not process.log_path.exists():
            continue
        text = process.log_path.read_text(errors="replace")
        new = text[_READ.get(process.name, 0):]
        _READ[process.name] = len(text)
        at = new.find("Traceback")
        assert at < 0, (what, process.name, new[max(0, at - 1500):at + 4000])


_READ: dict[str, int] = {}


def test_the_edge_serves_its_description_without_a_key(fuzz: Fuzz) -> None:
    with urllib.request.urlopen(f"{fuzz.pipeline.url}/openapi.json", timeout=30) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("application/json")
        assert json.loads(resp.read()) == document(fuzz.pipeline.config)


def _check(status: int, headers: dict[str, list[str]], body: bytes, what: str) -> None:
    """``headers`` as schemathesis gives them: lower-case names, lists of values."""
    if status in OVERLOAD:
        assert headers.get("retry-after"), (what, status, body[:300])
        return
    assert status < 500, (what, status, body[:500])
    if status >= 400:
        error = json.loads(body)["error"]
        assert isinstance(error.get("message"), str), (what, status, body[:300])
        assert error["message"], (what, status, body[:300])


@pytest.mark.parametrize(("method", "path", "mode"), CASES)
def test_every_operation_never_5xx(fuzz: Fuzz, method: str, path: str,
                                   mode: schemathesis.GenerationMode) -> None:
    strategy = SCHEMA[path][method].as_strategy(generation_mode=mode)
    url = fuzz.pipeline.url

    @settings(max_examples=EXAMPLES, derandomize=True, database=None, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(strategy)
    def run(case: Any) -> None:
        if mode is POSITIVE and isinstance(case.body, dict | list):
            case.body = _integral(case.body)  # 1.0 is an integer to JSON Schema only
        response = case.call(base_url=url, headers=fuzz.auth, timeout=60)
        _check(response.status_code, response.headers, response.content,
               f"{method} {path} {case.path_parameters} {case.query} {case.body!r:.300}")

    run()
    _no_traceback(fuzz.pipeline, (method, path, mode))


_json = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False)
                     | st.text(max_size=12),
                     lambda inner: st.lists(inner, max_size=3)
                     | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=8)
_id = st.text(min_size=1, max_size=8) | st.integers(1, MAX_ID_LENGTH).map(lambda n: "i" * n)
_body = st.one_of(*[SCHEMA[p]["POST"].as_strategy(generation_mode=m).map(lambda c: c.body)
                    for p in PATHS for m in schemathesis.GenerationMode])
# Frames of the protocol's shapes (docs/websocket.md), valid as drawn.
_valid = st.one_of(
    st.fixed_dictionaries({"type": st.just("request"), "id": _id,
                           "path": st.sampled_from(sorted(PATHS)), "body": _body},
                          optional={"resumable": st.booleans(),
                                    "resume_grace": st.floats(0, 60)}),
    st.fixed_dictionaries({"type": st.just("cancel"), "id": _id}),
    st.fixed_dictionaries({"type": st.just("resume"), "id": _id,
                           "request_id": st.text(min_size=1, max_size=30),
                           "after": st.integers(0, 2**64)}),
    st.fixed_dictionaries({"type": st.sampled_from(["ping", "pong", "auth"])},
                          optional={"key": st.text(max_size=20)}),
)


@st.composite
def _frame(draw: st.DrawFn) -> Any:
    """A valid frame, or one with one field replaced by any JSON value or
    dropped, or any JSON value at all."""
    how = draw(st.sampled_from(["valid", "replace", "drop", "junk"]))
    if how == "junk":
        return draw(_json)
    frame: dict[str, Any] = draw(_valid)
    if how != "valid":
        key = draw(st.sampled_from(sorted(frame)))
        if how == "drop":
            del frame[key]
        else:
            frame[key] = draw(_json | st.integers() | st.text().map(lambda t: t * 20))
    return frame


# A frame as sent: JSON text mostly (bytes in data that does not fit a schema
# go as their repr), else raw text or binary.
_SENT = (_frame().map(lambda f: ("text", json.dumps(f, default=repr))),
         st.text(max_size=200).map(lambda t: ("text", t)),
         st.binary(max_size=200).map(lambda b: ("binary", b)))
_sent = st.integers(0, 7).flatmap(lambda i: _SENT[max(0, i - 5)])  # 6 in 8 are frames


async def _socket_round(url: str, auth: dict[str, str], frames: list[tuple[str, Any]]) -> None:
    """Send ``frames``, then a ping: the socket answers pong. No frame of
    these (all far below ``ws.max_message_bytes``) is a reason to close an
    authenticated socket; a handler that fails closes it, with 1000 as often
    as not, so any close fails the test."""
    async with aiohttp.ClientSession() as session, \
            session.ws_connect(f"{url}/v1/ws", headers=auth, autoping=True) as ws:
        for kind, data in frames:
            await (ws.send_str(data) if kind == "text" else ws.send_bytes(data))
        await ws.send_str('{"type":"ping"}')
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            msg = await ws.receive(timeout=deadline - time.monotonic())
            if msg.type is aiohttp.WSMsgType.TEXT and json.loads(msg.data).get("type") == "pong":
                return
            assert msg.type is aiohttp.WSMsgType.TEXT, (msg.type, ws.close_code, frames)
        raise AssertionError(f"no pong within 60 s after {frames!r:.500}")


def test_websocket_frames_never_crash_the_socket(fuzz: Fuzz) -> None:
    @settings(max_examples=WS_EXAMPLES, derandomize=True, database=None, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(st.lists(_sent, min_size=1, max_size=5))
    def run(frames: list[tuple[str, Any]]) -> None:
        asyncio.run(_socket_round(fuzz.pipeline.url, fuzz.auth, frames))

    run()
    _no_traceback(fuzz.pipeline, "websocket")


# gRPC (docs/grpc.md): a route of the five or a number no route has; a body of
# a schema's shape (fitting or not) as JSON, or bytes that are no JSON; the
# typed model and the resume fields as they come (NaN and negative graces too).
_gid = st.text(max_size=8) | st.integers(1, MAX_ID_LENGTH + 2).map(lambda n: "g" * n)
_ROUTE_OF = {api: route for route, api in GRPC_ROUTES.items()}
# Half of them a route with a body of its own endpoint's schema (fitting or
# not), so that generations run; the rest any route with any body.
_routed = st.sampled_from(sorted(p for p in PATHS if PATHS[p] in _ROUTE_OF)).flatmap(
    lambda path: st.tuples(st.just(_ROUTE_OF[PATHS[path]]), st.one_of(*[
        SCHEMA[path]["POST"].as_strategy(generation_mode=m).map(lambda c: c.body)
        for m in schemathesis.GenerationMode])))
_unrouted = st.tuples(st.sampled_from(sorted(GRPC_ROUTES)) | st.integers(0, 2**31 - 1),
                      _body | st.binary(max_size=200))
_generate = st.builds(
    lambda routed, model, gid, resumable, grace: pb.GenerateRequest(
        route=routed[0], model=model, id=gid,
        body=routed[1] if isinstance(routed[1], bytes) else json.dumps(
            routed[1], default=repr).encode(),
        **({} if resumable is None else {"resumable": resumable}),
        **({} if grace is None else {"resume_grace": grace})),
    _routed | _unrouted,
    st.sampled_from(["", "tidegate-sim"]) | st.text(max_size=20), _gid,
    st.none() | st.booleans(), st.none() | st.floats())
_session_message = st.one_of(
    st.builds(lambda gid, g: pb.SessionRequest(id=gid, generate=g), _gid, _generate),
    st.builds(lambda gid: pb.SessionRequest(id=gid, cancel=pb.Cancel()), _gid),
    st.builds(lambda gid, rid, after: pb.SessionRequest(
        id=gid, resume=pb.Resume(request_id=rid, after=after)),
        _gid, st.text(max_size=30), st.integers(0, 2**64 - 1)),
    st.builds(lambda gid: pb.SessionRequest(id=gid), _gid),  # no action
)
# A bug's statuses: grpcio's for an exception a handler let out (UNKNOWN),
# and what no tidegate path means to send.
_BUG = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.DATA_LOSS}
_BUG_CODES = {code.value[0] for code in _BUG}


def _grpc_target(fuzz: Fuzz) -> str:
    return f"127.0.0.1:{fuzz.pipeline.config.edge.grpc_port}"


async def _generate_round(fuzz: Fuzz, req: pb.GenerateRequest) -> None:
    async with grpc.aio.insecure_channel(_grpc_target(fuzz)) as channel:
        call = pb_grpc.GatewayStub(channel).Generate(
            req, metadata=(("authorization", f"Bearer {fuzz.key}"),), timeout=60)
        ended = await _ended(call, [])
    assert ended[0] not in _BUG, (*ended, req)


async def _session_round(fuzz: Fuzz, messages: list[pb.SessionRequest]) -> None:
    async with grpc.aio.insecure_channel(_grpc_target(fuzz)) as channel:
        call = pb_grpc.GatewayStub(channel).Session(
            iter(messages), metadata=(("authorization", f"Bearer {fuzz.key}"),), timeout=60)
        events: list[pb.GenerateResponse] = []
        ended = await _ended(call, events)
    assert ended[0] not in _BUG, (*ended, messages)
    failed = [e for e in events if e.HasField("error") and e.error.code in _BUG_CODES]
    assert not failed, (failed, messages)


async def _ended(call: Any, events: list[pb.GenerateResponse]) -> tuple[grpc.StatusCode, str]:
    """Read ``call`` to its end (its events into ``events``): its status and details."""
    try:
        async for event in call:
            events.append(event)
    except grpc.aio.AioRpcError as exc:
        return exc.code(), str(exc.details())
    return grpc.StatusCode.OK, ""


def test_grpc_messages_never_fail_as_a_bug(fuzz: Fuzz) -> None:
    @settings(max_examples=GRPC_EXAMPLES, derandomize=True, database=None, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(_generate)
    def generate(req: pb.GenerateRequest) -> None:
        asyncio.run(_generate_round(fuzz, req))

    @settings(max_examples=GRPC_EXAMPLES, derandomize=True, database=None, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(st.lists(_session_message, min_size=1, max_size=5))
    def session(messages: list[pb.SessionRequest]) -> None:
        asyncio.run(_session_round(fuzz, messages))

    generate()
    _no_traceback(fuzz.pipeline, "grpc generate")
    session()
    _no_traceback(fuzz.pipeline, "grpc session")


async def _leftovers(redis_url: str) -> tuple[list[str], int]:
    """Reservation records and held leases of this pipeline's quota store,
    and how many windows it keeps (> 0: requests were reserved here at all)."""
    client = connect_redis(redis_url, timeout=5.0)
    base = f"{PREFIX}:{{{PREFIX}q}}"
    try:
        windows = len([k async for k in client.scan_iter(f"{base}:w:*")])
        left = [k async for k in client.scan_iter(f"{base}:r:*")]
        for key in [k async for k in client.scan_iter(f"{base}:c:*")]:
            if await client.zcard(key):
                left.append(key)
        return left, windows
    finally:
        await client.aclose()


def test_after_the_fuzz_every_tier_serves_and_nothing_is_reserved(fuzz: Fuzz) -> None:
    pipeline = fuzz.pipeline
    for process in pipeline.processes:
        assert process.running, process.describe_failure(process.name)
    status, body = pipeline.post("/v1/chat/completions", {
        "model": "tidegate-sim", "stream": True, "max_tokens": 3,
        "messages": [{"role": "user", "content": "hi"}]}, key=fuzz.key)
    assert status == 200, body[:300]
    assert body.rstrip().endswith(b"data: [DONE]")
    # Every reservation is settled once its request ends (usage reconciles
    # it, a refusal refunds it); cancelled and background ones take a moment.
    left, windows = asyncio.run(_leftovers(pipeline.config.redis.url))
    # (Read at once: a window's keys go a minute after its last request.)
    assert windows, "no request was reserved under this prefix: the check reads the wrong keys"
    deadline = time.monotonic() + 120
    while left and time.monotonic() < deadline:
        time.sleep(1.0)
        left, _ = asyncio.run(_leftovers(pipeline.config.redis.url))
    assert not left, f"reservations left behind: {left[:10]}"
    _no_traceback(pipeline, "after")
