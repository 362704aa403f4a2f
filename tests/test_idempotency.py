"""``Idempotency-Key``: a request sent again is the same request
(edge/idempotency.py, docs/resume.md "Sending a request again").

Against real servers (two edges, the stream log in JetStream, the fake
backend counting what it was asked): a client whose connection broke sends
its request again on another edge and reads one stream; nothing runs twice.
"""

# ruff: noqa: F811
# The pipeline fixtures come from tests/test_resume.py; the tests taking them
# "redefine" them for ruff (F811): that is how pytest finds them.
from __future__ import annotations

import time
import uuid
from types import SimpleNamespace
from typing import Any

import aiohttp
import nats
import pytest

from bench.fake_backend import FakeBackend
from edge import idempotency
from tests.pipeline import record_for
from tests.test_resume import (
    AUTH,
    RESUMABLE,
    Sse,
    abort,
    backend,  # noqa: F401
    backend_events,
    body,
    payloads,
    pipelines,  # noqa: F401
    replay,
)
from tidegate import apis
from tidegate import config as tgconfig
from tidegate.errors import ApiError
from tidegate.wire import streamlog
from tidegate.wire.protocol import Api

CHAT = apis.of(Api.CHAT).path


@pytest.mark.parametrize("bad", ["", " ", "x" * 256, "clé", "a\tb"])
def test_a_malformed_key_is_refused(bad: str) -> None:
    with pytest.raises(ApiError) as caught:
        idempotency.key_of({idempotency.HEADER: bad})
    assert caught.value.status == 400
    assert caught.value.code == "invalid_idempotency_key"


def test_the_id_is_the_tenants_and_keys_own() -> None:
    one = idempotency.request_id("acme", "k-1", CHAT)
    assert one == idempotency.request_id("acme", "k-1", CHAT)
    assert len(one) == 24
    assert int(one, 16) >= 0
    assert one != idempotency.request_id("acme", "k-2", CHAT)
    assert one != idempotency.request_id("other", "k-1", CHAT)
    # The tenant's length keeps ("ab", "c...") and ("a", "bc...") apart.
    assert idempotency.request_id("ab", "c", CHAT) != idempotency.request_id("a", "bc", CHAT)
    # One key on two routes names two requests: never one route's answer on
    # the other (a chat stream replayed to an Anthropic client).
    routes = {idempotency.request_id("acme", "k-1", d.path) for d in apis.ALL}
    assert len(routes) == len(apis.ALL)
    assert idempotency.key_of({}) is None
    assert idempotency.key_of({idempotency.HEADER: " k-1 "}) == "k-1"


class _Log:
    """A StreamLog whose broker is unreachable for the first ``down`` lookups."""

    def __init__(self, down: int, created_ms: int) -> None:
        self.down = down
        self.calls = 0
        self.created_ms = created_ms

    async def lookup(self, request_id: str, tenant: str) -> streamlog.LogOpen:
        self.calls += 1
        if self.calls <= self.down:
            raise ApiError(503, "The stream log is unavailable (TimeoutError); retry later.",
                           type="server_error", code="broker_unavailable")
        if self.created_ms < 0:
            raise ApiError(404, "No such stream.", type="invalid_request_error",
                           code="stream_not_found")
        return streamlog.LogOpen(tenant, True, int(Api.CHAT), self.created_ms, 30.0)


def _state(log: _Log, patience: float) -> Any:
    config = tgconfig.from_dict({"edge": {"publish_patience": patience}})
    return SimpleNamespace(streamlog=log, config=config)


async def test_the_log_lookup_waits_out_a_broker_that_is_briefly_away() -> None:
    """As the publish that follows it: a NATS node's death must not turn a
    request sent again into a 503 (a chaos run's 15 broker_unavailable)."""
    now_ms = int(time.time() * 1000)
    log = _Log(down=2, created_ms=now_ms)
    assert await idempotency.sent_before(_state(log, 5.0), "a" * 24, "t") == (True, True)
    assert log.calls == 3
    old = _Log(down=0, created_ms=now_ms - 200_000)  # past the 120 s duplicate window
    assert await idempotency.sent_before(_state(old, 5.0), "a" * 24, "t") == (True, False)
    assert await idempotency.sent_before(_state(_Log(0, -1), 5.0), "a" * 24, "t") == (
        False, False)
    away = _Log(down=10**6, created_ms=now_ms)
    with pytest.raises(ApiError) as caught:
        await idempotency.sent_before(_state(away, 1.0), "a" * 24, "t")
    assert caught.value.code == "broker_unavailable"
    assert away.calls >= 2  # tried again within its patience, then gave up


def keyed(headers: dict[str, str], key: str) -> dict[str, str]:
    return {**headers, idempotency.HEADER: key}


pipeline_test = pytest.mark.pipeline


@pipeline_test
async def test_a_resumable_request_sent_again_reads_its_one_stream(
        pipelines: Any, backend: FakeBackend) -> None:
    """The connection breaks after 10 events; the same request, same key, on
    the other edge: the whole stream from its first event, byte-exact, and
    the backend asked once."""
    pipeline = pipelines()
    a, b = pipeline.edge_urls
    marker = f"idem-{uuid.uuid4().hex}"
    key = str(uuid.uuid4())
    async with aiohttp.ClientSession() as session:
        first = await session.post(f"{a}/v1/chat/completions",
                                   json=body(marker, max_tokens=200), headers=keyed(RESUMABLE, key))
        assert first.status == 200
        request_id = first.headers["x-request-id"]
        assert request_id == idempotency.request_id("default", key, CHAT)
        assert idempotency.REPLAYED_HEADER not in first.headers
        got = await Sse().read(first, events=10)
        abort(first)
        again = await session.post(f"{b}/v1/chat/completions",
                                   json=body(marker, max_tokens=200), headers=keyed(RESUMABLE, key))
        assert again.status == 200, await again.text()
        assert again.headers["x-request-id"] == request_id
        assert again.headers[idempotency.REPLAYED_HEADER] == "true"
        second = await Sse().read(again)
        full = await replay(session, b, request_id)
    assert second.done
    assert second.events[:10] == got.events
    assert second.events == full.events
    assert payloads(second) == backend_events(backend, marker)  # one backend request


@pipeline_test
async def test_a_plain_request_sent_again_is_refused_not_run_twice(
        pipelines: Any, backend: FakeBackend) -> None:
    pipeline = pipelines()
    a, b = pipeline.edge_urls
    marker = f"idem-plain-{uuid.uuid4().hex}"
    key = str(uuid.uuid4())
    async with aiohttp.ClientSession() as session:
        first = await session.post(f"{a}/v1/chat/completions",
                                   json=body(marker, max_tokens=20), headers=keyed(AUTH, key))
        assert first.status == 200
        assert (await Sse().read(first)).done
        again = await session.post(f"{b}/v1/chat/completions",
                                   json=body(marker, max_tokens=20), headers=keyed(AUTH, key))
        assert again.status == 409
        error = (await again.json())["error"]
        other = await session.post(f"{b}/v1/chat/completions", json=body(marker, max_tokens=20),
                                   headers=keyed(AUTH, key + "-other"))
        assert (await Sse().read(other)).done
    assert error["code"] == "idempotency_key_in_use"
    assert error["param"] == idempotency.HEADER
    assert len(record_for(backend, marker)) == 2  # the first and the other key's, not the 409


@pipeline_test
async def test_one_key_on_another_route_is_another_request(
        pipelines: Any, backend: FakeBackend) -> None:
    """A resumable chat request, then the same key on /v1/responses: the
    second runs as the Responses request it is (typed events), not the chat
    stream replayed from its log."""
    pipeline = pipelines()
    a, b = pipeline.edge_urls
    marker = f"idem-route-{uuid.uuid4().hex}"
    key = str(uuid.uuid4())
    async with aiohttp.ClientSession() as session:
        first = await session.post(f"{a}/v1/chat/completions",
                                   json=body(marker, max_tokens=20), headers=keyed(RESUMABLE, key))
        assert first.status == 200
        assert (await Sse().read(first)).done
        again = await session.post(
            f"{b}/v1/responses", headers=keyed(RESUMABLE, key),
            json={"model": body(marker)["model"], "input": marker, "stream": True,
                  "max_output_tokens": 20})
        assert again.status == 200, await again.text()
        text = await again.text()
    assert idempotency.REPLAYED_HEADER not in again.headers
    assert again.headers["x-request-id"] != first.headers["x-request-id"]
    assert "event: response.completed" in text, text[-500:]
    assert "chat.completion.chunk" not in text
    # Both ran: the chat request, and the Responses one on the backend's own route.
    assert len(record_for(backend, marker)) == 1
    assert [r.body.get("input") for r in list(backend.records)
            if r.path == "/v1/responses" and r.body.get("input") == marker] == [marker]


@pipeline_test
async def test_a_request_refused_at_publish_leaves_no_log(
        pipelines: Any, backend: FakeBackend) -> None:
    """A number past 64 bits passes JSON validation and is refused when the
    request is encoded: 400, and no stream log opened for it (the fuzzer
    found one opened first: a resume of the id then waited for a stream that
    never came). The same key with a good body then runs as a first try."""
    pipeline = pipelines()
    a, _ = pipeline.edge_urls
    marker = f"idem-big-{uuid.uuid4().hex}"
    key = str(uuid.uuid4())
    request_id = idempotency.request_id("default", key, CHAT)
    async with aiohttp.ClientSession() as session:
        bad = await session.post(f"{a}/v1/chat/completions", headers=keyed(RESUMABLE, key),
                                 json=body(marker, max_tokens=5, x_number=2**70))
        assert bad.status == 400, await bad.text()
        assert (await bad.json())["error"]["code"] == "invalid_value"
        resumed = await session.get(f"{a}/v1/streams/{request_id}", headers=AUTH)
        assert resumed.status == 404, await resumed.text()
        good = await session.post(f"{a}/v1/chat/completions", headers=keyed(RESUMABLE, key),
                                  json=body(marker, max_tokens=5))
        assert good.status == 200, await good.text()
        assert idempotency.REPLAYED_HEADER not in good.headers
        assert (await Sse().read(good)).done


@pipeline_test
async def test_a_log_whose_request_was_never_published_gets_it_published(
        pipelines: Any, backend: FakeBackend) -> None:
    """The first edge opened the stream's log and died before publishing the
    request: the second try finds the log, publishes the request, and reads
    its stream to the end (a replay alone would wait for nobody)."""
    pipeline = pipelines()
    _, b = pipeline.edge_urls
    marker = f"idem-unpublished-{uuid.uuid4().hex}"
    key = str(uuid.uuid4())
    request_id = idempotency.request_id("default", key, CHAT)
    config = pipeline.config
    nc = await nats.connect(config.nats.url)
    try:
        js = nc.jetstream()
        entry = streamlog.LogOpen("default", True, int(Api.CHAT), int(time.time() * 1000), 30.0)
        await js.publish(streamlog.subject(config.nats.subjects, request_id), entry.encode(),
                         headers={"Nats-Msg-Id": f"{request_id}.open"})
    finally:
        await nc.close()
    async with aiohttp.ClientSession() as session:
        again = await session.post(f"{b}/v1/chat/completions",
                                   json=body(marker, max_tokens=30), headers=keyed(RESUMABLE, key))
        assert again.status == 200, await again.text()
        assert again.headers[idempotency.REPLAYED_HEADER] == "true"
        got = await Sse().read(again)
    assert got.done
    assert payloads(got) == backend_events(backend, marker)
