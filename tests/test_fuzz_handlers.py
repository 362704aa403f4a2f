"""The dispatcher's and the worker's message handlers, fuzzed against real servers.

Issue 24: no single message from a tenant may crash a tier or wedge a
consumer. Hypothesis replaces one field of a valid request envelope (or one
field of its body) with a value of any msgpack type and range (integers at
and past the 64-bit edges, NaN and infinities, nested containers, strings with
subject syntax), publishes it to the real JetStream stream the handler reads,
and hands the delivered message to the real handler: the dispatcher's
``Dispatcher.handle_safely`` (quotas in a real redis-server) and the worker's
``Pool.run_job`` (the built-in simulator backend). Every message must be
settled, acked or terminated, never left for redelivery (a poison message
redelivered forever holds a slot of the consumer each time), and nothing may
escape the handler.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext

from dispatcher.admission import QuotaAdmission
from dispatcher.quota import QuotaStore
from dispatcher.quota import connect as connect_quota_store
from dispatcher.service import Dispatcher
from tidegate import config as tgconfig
from tidegate.broker import broker
from tidegate.control.policies import Policy, PolicySet
from tidegate.wire.protocol import Admission, Api, Request, Status, decode_session
from workers.backends import create_backend
from workers.job_context import JobContext
from workers.service import Pool

pytestmark = pytest.mark.pipeline

EDGE = "fuzzedge"


def _config(nats_url: str, redis_url: str) -> tgconfig.Config:
    return tgconfig.from_dict({
        "nats": {"url": nats_url}, "redis": {"url": redis_url},
        "models": [{"name": "tidegate-sim", "aliases": ["sim"],
                    "simulator": {"ttft": 0.0, "tokens_per_second": 10_000.0, "length": 3}}]})


def _valid() -> dict[str, Any]:
    now = int(time.time() * 1000)
    request = Request(
        id=secrets.token_hex(12), reply=f"tg.out.{EDGE}.{secrets.token_hex(12)}",
        model="tidegate-sim", api=Api.CHAT, stream=True,
        body={"model": "tidegate-sim", "max_tokens": 3,
              "messages": [{"role": "user", "content": "x"}]},
        created_ms=now, deadline_ms=now + 60_000, window_bytes=65536, window_msgs=128,
        tenant="fuzz", edge=EDGE)
    raw = msgpack.unpackb(request.encode())
    assert isinstance(raw, dict)
    return raw


FIELDS = sorted(_valid())
BODY_FIELDS = ["model", "max_tokens", "messages", "temperature", "top_p", "n", "stop",
               "stream_options", "tools", "logit_bias", "seed", "max_completion_tokens",
               "prompt", "input", "user"]

# Scalars at every edge of msgpack's ranges, then containers of them.
_INTS = st.sampled_from([0, -1, 1, 2**31, 2**32, 2**53 + 1, 2**63 - 1, -(2**63), 2**64 - 1,
                         -(2**31)]) | st.integers(min_value=-(2**63), max_value=2**64 - 1)
_SCALARS = (st.none() | st.booleans() | _INTS
            | st.floats(allow_nan=True, allow_infinity=True)
            | st.text(max_size=40) | st.binary(max_size=40)
            | st.sampled_from([">", "*", "tg.out.>", "$KV.TG_KEYS.x", "\r\n", "", "a" * 300]))
VALUES = st.recursive(_SCALARS, lambda inner: st.lists(inner, max_size=4)
                      | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)


# Output lengths: a worker generates what the body asks for. Bounding them
# (per model, and in the simulator) is issue 24 item 5, done apart from this
# work; until then the worker's fuzz keeps their numbers small (their types
# are still fuzzed), or one example would generate 2^63 tokens.
LENGTHS = {"max_tokens", "max_completion_tokens", "max_output_tokens", "n"}


def _small(value: Any) -> bool:
    return not (isinstance(value, int | float) and not isinstance(value, bool)
                and not value <= 64)  # NaN too


@st.composite
def envelopes(draw: st.DrawFn, worker: bool = False) -> bytes:
    raw = _valid()
    if draw(st.booleans()):
        raw[draw(st.sampled_from(FIELDS))] = draw(VALUES)
    else:
        name = draw(st.sampled_from(BODY_FIELDS))
        raw["body"][name] = draw(VALUES.filter(_small) if worker and name in LENGTHS
                                 else VALUES)
    if draw(st.booleans()):  # a second field, so pairs of odd values meet too
        raw[draw(st.sampled_from(FIELDS))] = draw(VALUES)
    return bytes(msgpack.packb(raw))


@dataclass
class Harness:
    loop: asyncio.AbstractEventLoop
    nc: NATS
    js: JetStreamContext
    config: tgconfig.Config
    dispatcher: Dispatcher
    pool: Pool
    backend: Any

    def run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(asyncio.wait_for(coro, 60))


@pytest.fixture(scope="module")
def harness(module_nats_url: str, module_redis_url: str) -> Iterator[Harness]:
    loop = asyncio.new_event_loop()
    config = _config(module_nats_url, module_redis_url)

    async def setup() -> Harness:
        nc = NATS()
        await nc.connect(module_nats_url)
        js = broker.jetstream(nc, config.nats)
        await broker.ensure_streams(js, config)
        redis = connect_quota_store(config.redis.url, config.redis.timeout)
        store = QuotaStore(redis, prefix=config.nats.subject_prefix,
                           lease=config.edge.request_timeout)
        # A policy, so every request goes through the quota scripts' arithmetic.
        policies = PolicySet([Policy(tenant="fuzz", rpm=10**9, tpm=10**12)])
        admission = QuotaAdmission(store, policies, config.model_index(), fail_open=False)
        ctx = JobContext(config=config, nc=nc, control_subject="tg.ctl.fuzzworker")
        model = config.models[0]
        return Harness(loop, nc, js, config, Dispatcher(config, nc, js, admission),
                       Pool(config, ctx), create_backend(model, config.worker))

    h = loop.run_until_complete(setup())
    try:
        yield h
    finally:
        loop.run_until_complete(h.nc.close())
        loop.close()


async def _settled(h: Harness, stream: str, durable: str) -> None:
    """Neither pending nor waiting for an ack: the handler acked or terminated it."""
    await h.nc.flush()
    deadline = time.monotonic() + 10
    while True:
        info = await h.js.consumer_info(stream, durable)
        if not info.num_ack_pending and not info.num_pending:
            return
        assert time.monotonic() < deadline, (
            f"message left unsettled on {stream}/{durable}: {info.num_ack_pending} "
            f"ack pending, {info.num_pending} pending")
        await asyncio.sleep(0.02)


async def _one(h: Harness, stream: str, subject: str, durable: str, data: bytes) -> Any:
    sub = await h.js.pull_subscribe(subject, durable=durable, stream=stream)
    try:
        await h.js.publish(subject, data)
        (msg,) = await sub.fetch(1, timeout=10)
        return msg
    finally:
        await sub.unsubscribe()


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=envelopes())
def test_the_dispatcher_settles_every_request_message(harness: Harness, data: bytes) -> None:
    h = harness
    s = h.config.nats.subjects

    async def go() -> None:
        subject = s.request("interactive", "fuzz")
        msg = await _one(h, s.requests_stream, subject, "fuzzdispatch", data)
        await h.dispatcher.handle_safely(msg)
        await _settled(h, s.requests_stream, "fuzzdispatch")
        await _drain_jobs(h)

    h.run(go())


async def _drain_jobs(h: Harness) -> None:
    """Jobs the dispatcher published go to the worker's fuzz below, not here."""
    await h.js.purge_stream(h.config.nats.subjects.jobs_stream)


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=envelopes(worker=True))
def test_the_worker_settles_every_job_message(harness: Harness, data: bytes) -> None:
    h = harness
    s = h.config.nats.subjects

    async def go() -> None:
        subject = s.job("tidegate-sim")
        msg = await _one(h, s.jobs_stream, subject, "fuzzwork", data)
        await h.pool.run_job(msg, h.backend)
        await _settled(h, s.jobs_stream, "fuzzwork")

    h.run(go())


class _Overflowing:
    """An admission policy with a bug a message can trigger (as the quota
    arithmetic could): the dispatcher must still settle the message."""

    async def admit(self, request: Request) -> Any:
        raise OverflowError("cannot convert float infinity to integer")

    async def refund(self, request_id: str) -> None:
        pass


def test_a_poison_request_is_answered_and_terminated(harness: Harness) -> None:
    """A request whose handling raises (not a broker or Redis failure) once
    stayed unacked, redelivered forever; now the edge gets a 400 and the
    message is terminated."""
    h = harness
    s = h.config.nats.subjects
    raw = _valid()
    answers: list[bytes] = []
    dispatcher = Dispatcher(h.config, h.nc, h.js, _Overflowing())

    async def go() -> None:
        async def answered(m: Any) -> None:
            answers.append(m.data)

        sub = await h.nc.subscribe(raw["reply"], cb=answered)
        msg = await _one(h, s.requests_stream, s.request("interactive", "fuzz"),
                         "fuzzdispatch", bytes(msgpack.packb(raw)))
        await dispatcher.handle_safely(msg)
        await _settled(h, s.requests_stream, "fuzzdispatch")
        await h.nc.flush()
        deadline = time.monotonic() + 10
        while not answers:
            assert time.monotonic() < deadline, "no answer on the request's reply subject"
            await asyncio.sleep(0.02)
        await sub.unsubscribe()
        status = decode_session(answers[0])
        assert isinstance(status, Status)
        assert status.admission is Admission.REJECTED
        assert status.error is not None
        assert status.error.status == 400
        assert status.error.code == "unprocessable_request"

    h.run(go())
