"""Bodies larger than a NATS message cross the broker by claim check
(tidegate.broker.bodies), against a real nats-server (max_payload: its
default 1 MiB), redis-server and the fake backend, which records what it got.

A 24 MiB vision request (two 10 MiB base64 images and a 4 MiB text prompt)
streams through chat, Responses and Messages, resumable too, and goes on on
another worker when its own is killed mid-stream: the backend receives the
text and the images byte-exact each time, and the stored body is deleted
once the job is done."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import json
import os
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import msgpack
import nats
import openai
import pytest

from bench.fake_backend import FakeBackend
from bench.fake_records import FakeConfig
from tests.pipeline import DEV_KEY, Pipeline, threaded_fake_backend
from tests.poll import eventually
from tests.test_batch_pipeline import lines_of, poll, submit
from tidegate import config as config_
from tidegate.broker import bodies, objects
from tidegate.wire.protocol import Api, Request

pytestmark = pytest.mark.pipeline

AUTH = {"Authorization": f"Bearer {DEV_KEY}"}
TOKENS = 200  # at 10 ms each: 2 s streams, long enough to kill a worker in


def test_the_threshold_is_half_a_message_unless_set() -> None:
    assert bodies.threshold(config_.from_dict({}), 1 << 20) == 512 << 10
    small = config_.from_dict({"edge": {"claim_check_bytes": 4096}})
    assert bodies.threshold(small, 1 << 20) == 4096
    big = config_.from_dict({"edge": {"claim_check_bytes": 8 << 20}})
    assert bodies.threshold(big, 1 << 20) < 1 << 20  # never past what a message holds


def test_a_claimed_envelope_carries_the_name_and_no_body() -> None:
    request = Request(id="r1", reply="tg.out.e.r1", model="m", api=Api.CHAT, stream=True,
                      body={"messages": [{"role": "user", "content": "x" * 100}]},
                      created_ms=0, deadline_ms=0, window_bytes=1, window_msgs=1)
    assert b"claim" not in request.encode()  # an inline body's envelope is as it was
    assert Request.decode(request.encode()).claim == ""
    claimed = Request.decode(dataclasses.replace(request, body={}, claim="r1").encode())
    assert (claimed.body, claimed.claim) == ({}, "r1")


@pytest.fixture(scope="module")
def backend() -> Iterator[FakeBackend]:
    with threaded_fake_backend(config=FakeConfig(models=("fake",), ttft=0.01, itl=0.01,
                                                 tokens=TOKENS, deterministic=True,
                                                 keep_output=True)) as fake:
        yield fake


@pytest.fixture
def pipeline(tmp_path: Path, nats_server: Any, redis_server: Any,
             backend: FakeBackend) -> Iterator[Pipeline]:
    p = Pipeline(tmp_path, nats_server.url, redis_server.url, workers=2, overrides={
        "session": {"heartbeat_interval": 1.0, "worker_lost_after": 40, "ack_timeout": 60.0},
        "worker": {"ack_wait": 30.0},  # a 24 MiB body is read before the job's first ack
        "models": [{"name": "fake", "backend": "openai", "base_url": backend.base_url,
                    "max_streams": 16, "messages": "passthrough"}]})
    try:
        p.start()
        yield p
    finally:
        p.stop()


def _payload() -> tuple[str, str, str]:
    """(marker, 4 MiB of text, 10 MiB of base64): fresh per request."""
    marker = uuid.uuid4().hex
    text = f"{marker} " + "lorem ipsum dolor sit amet " * (4 * (1 << 20) // 27)
    image = base64.b64encode(os.urandom(10 * (1 << 20) * 3 // 4)).decode()
    return marker, text, image


def _chat(text: str, image: str) -> dict[str, Any]:
    url = f"data:image/png;base64,{image}"
    return {"model": "fake", "stream": True, "messages": [{"role": "user", "content": [
        {"type": "text", "text": text},
        {"type": "image_url", "image_url": {"url": url}},
        {"type": "image_url", "image_url": {"url": url, "detail": "high"}}]}]}


def _responses(text: str, image: str) -> dict[str, Any]:
    return {"model": "fake", "stream": True, "input": [{"role": "user", "content": [
        {"type": "input_text", "text": text},
        {"type": "input_image", "image_url": f"data:image/png;base64,{image}"},
        {"type": "input_image", "image_url": f"data:image/jpeg;base64,{image}"}]}]}


def _messages(text: str, image: str) -> dict[str, Any]:
    block = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": image}}
    return {"model": "fake", "stream": True, "max_tokens": 1000, "messages": [
        {"role": "user", "content": [{"type": "text", "text": text}, block, block]}]}


async def _stream(session: aiohttp.ClientSession, url: str, body: dict[str, Any],
                  headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    async with session.post(url, json=body, headers={**AUTH, **(headers or {})}) as resp:
        return resp.status, await resp.read()


def _received(backend: FakeBackend, marker: str) -> list[str]:
    """Each body the backend got for ``marker``'s request, as JSON text."""
    return [text for text in (json.dumps(r.body) for r in list(backend.records))
            if marker in text]


async def _stored(pipeline: Pipeline) -> int:
    """How many claimed bodies the store still holds."""
    nc = await nats.connect(pipeline.config.nats.url)
    try:
        stream = f"OBJ_{pipeline.config.nats.subjects.bodies_bucket}"
        info = await nc.jetstream().stream_info(stream)
        return int(info.state.messages)
    finally:
        await nc.close()


@pytest.mark.parametrize(("path", "make", "resumable"), [
    ("/v1/chat/completions", _chat, False), ("/v1/chat/completions", _chat, True),
    ("/v1/responses", _responses, False), ("/v1/messages", _messages, False)])
async def test_a_24_mib_vision_request_streams_and_the_backend_gets_it_byte_exact(
        pipeline: Pipeline, backend: FakeBackend, path: str, make: Any,
        resumable: bool) -> None:
    marker, text, image = _payload()
    headers = {"X-Tidegate-Resumable": "true"} if resumable else {}
    async with aiohttp.ClientSession() as session:
        status, raw = await _stream(session, pipeline.url + path, make(text, image), headers)
    assert status == 200, raw[:500]
    assert raw.rstrip().endswith(b"[DONE]") or b"message_stop" in raw or \
        b"response.completed" in raw, raw[-300:]
    (got,) = _received(backend, marker)
    assert json.dumps(text) in got  # the text, whole, as one JSON string
    assert got.count(image) == 2  # both images, every byte
    await eventually(lambda: _none_stored(pipeline), 30, "the claimed body deleted")


async def _none_stored(pipeline: Pipeline) -> bool:
    return await _stored(pipeline) == 0


async def test_a_claimed_request_goes_on_when_its_worker_dies(
        pipeline: Pipeline, backend: FakeBackend) -> None:
    """The shipped failover (continue): the other worker reads the body from
    the store again and continues the text; the backend got the big body
    twice, the second time as the same messages plus the delivered text."""
    marker, text, image = _payload()
    body = {**_chat(text, image), "stream_options": {"include_usage": True}}
    async with aiohttp.ClientSession() as session:
        task = asyncio.ensure_future(_stream(session, pipeline.url + "/v1/chat/completions",
                                             body))

        async def first_tokens() -> bool:
            return any(marker in json.dumps(r.body) and r.events_written > 20
                       for r in list(backend.records))
        await eventually(first_tokens, 60, "the first worker streaming")
        assert not task.done()
        pipeline.workers[_on(backend, marker, pipeline)].kill()
        status, raw = await asyncio.wait_for(task, 120)
    assert status == 200
    assert raw.rstrip().endswith(b"[DONE]"), raw[-300:]
    assert b'"error"' not in raw
    got = _received(backend, marker)
    assert len(got) == 2, "the job ran again on the other worker"
    for sent in got:
        assert json.dumps(text) in sent
        assert sent.count(image) == 2
    await eventually(lambda: _none_stored(pipeline), 30, "the claimed body deleted")


def _on(backend: FakeBackend, marker: str, pipeline: Pipeline) -> int:
    """Which worker (0 or 1) runs ``marker``'s request: the one whose
    connection the backend record came from."""
    record = next(r for r in list(backend.records) if marker in json.dumps(r.body))
    port = int(record.peer.rsplit(":", 1)[1])
    for i, worker in enumerate(pipeline.workers):
        if worker.pid is not None and port in _local_ports(worker.pid):
            return i
    raise AssertionError("no worker holds the backend connection")


def _local_ports(pid: int) -> set[int]:
    """The local TCP ports of ``pid``'s sockets (from /proc)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports = set()
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[9] in inodes:
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


async def test_a_body_gone_from_the_store_is_told_apart(nats_server: Any) -> None:
    """Stored, read back equal; deleted (its TTL passed), BodyLost: the
    dispatcher and the worker answer it with ``request_body_lost``."""
    config = config_.from_dict({"nats": {"subject_prefix": "cc" + uuid.uuid4().hex[:6]}})
    nc = await nats.connect(nats_server.url)
    try:
        js = nc.jetstream()
        await bodies.ensure(js, config)
        _, text, image = _payload()
        request = Request(id=uuid.uuid4().hex[:24], reply="r", model="fake", api=Api.CHAT,
                          stream=True, body=_chat(text, image), created_ms=0,
                          deadline_ms=0, window_bytes=1, window_msgs=1)
        claimed = await bodies.check_in(js, config, request, nc.max_payload)
        assert len(claimed.encode()) < 4096
        assert (await bodies.resolve(js, config, claimed)).body == request.body
        bodies.discard(js, config, claimed)
        await eventually(lambda: _gone(js, config, claimed), 10, "the body deleted")
        with pytest.raises(bodies.BodyLost):
            await bodies.resolve(js, config, claimed)
        # A stored body that is no map is poison, not a lost body to retry.
        await objects.put(js, config.nats.subjects.bodies_bucket, claimed.claim,
                          _once(msgpack.packb([1, 2])))
        with pytest.raises(bodies.BodyUnreadable):
            await bodies.resolve(js, config, claimed)
    finally:
        await nc.close()


async def _once(data: bytes) -> AsyncIterator[bytes]:
    yield data


async def _gone(js: Any, config: Any, claimed: Request) -> bool:
    try:
        await bodies.resolve(js, config, claimed)
    except bodies.BodyLost:
        return True
    return False


async def test_a_batch_line_too_large_for_a_message_runs(pipeline: Pipeline,
                                                         backend: FakeBackend) -> None:
    """The batch runner claim-checks a line as the edge does a request."""
    marker, text, image = _payload()
    body = {k: v for k, v in _chat(text, image).items() if k != "stream"}
    line = {"custom_id": marker, "method": "POST", "url": "/v1/chat/completions",
            "body": body}
    async with openai.AsyncOpenAI(base_url=pipeline.base_url, api_key=DEV_KEY,
                                  max_retries=0, timeout=120) as client:
        batch = await submit(client, [line])
        done = await poll(client, batch.id, {"completed", "failed", "expired"}, within=120)
        assert done.status == "completed", done
        (out,) = await lines_of(client, done.output_file_id)
    assert (out["custom_id"], out["response"]["status_code"]) == (marker, 200), out
    (got,) = _received(backend, marker)
    assert json.dumps(text) in got
    assert got.count(image) == 2
    await eventually(lambda: _none_stored(pipeline), 30, "the claimed body deleted")
