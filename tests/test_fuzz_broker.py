"""Broker input is untrusted: garbage on every subject a tier listens to.

A live pipeline (real nats-server, redis-server, edge, dispatcher and worker
processes) gets truncated msgpack, wrong types, huge sizes, unknown versions,
a Chunk for a session that does not exist, a replayed Done, and request/job
envelopes that decode but make no sense, on every subject and bucket the tiers
read. Afterwards every tier is still running, answers a request with exactly
the output it gave before, and has counted what it dropped.
"""

from __future__ import annotations

import asyncio
import json
import re
import secrets
import time
from collections.abc import Iterator
from typing import Any

import msgpack
import pytest
from nats.aio.client import Client as NATS

from tests.pipeline import Pipeline, running_pipeline
from tidegate.broker import broker
from tidegate.broker.kvwatch import snapshot
from tidegate.wire.protocol import VERSION, Api, Chunk, Done, Heartbeat, Kind, Request
from tidegate.wire.subjects import encode_token

pytestmark = [pytest.mark.pipeline, pytest.mark.asyncio]

EDGE_ID = "fuzzedge"
CHAT = "/v1/chat/completions"
BODY = {"model": "tidegate-sim", "stream": True, "max_tokens": 8,
        "messages": [{"role": "user", "content": "the same question"}]}


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory: pytest.TempPathFactory, module_nats_url: str,
             module_redis_url: str) -> Iterator[Pipeline]:
    yield from running_pipeline(tmp_path_factory.mktemp("brokerfuzz"), module_nats_url,
                                module_redis_url, metrics=True,
                                overrides={"edge": {"edge_id": EDGE_ID}})


def _request(**fields: Any) -> Request:
    now = int(time.time() * 1000)
    base: dict[str, Any] = dict(
        id=secrets.token_hex(12), reply=f"tg.out.{EDGE_ID}.{secrets.token_hex(12)}",
        model="tidegate-sim", api=Api.CHAT, stream=True,
        body={"model": "tidegate-sim", "messages": [{"role": "user", "content": "x"}]},
        created_ms=now, deadline_ms=now + 60_000, window_bytes=65536, window_msgs=128,
        tenant="fuzz", edge=EDGE_ID, mux=f"tg.out.{EDGE_ID}.mux")
    base.update(fields)
    return Request(**base)


def _garbage_envelopes() -> list[bytes]:
    """Bytes that must be dropped wherever they land."""
    valid = _request().encode()
    pack = msgpack.packb
    out = [
        b"", b"\x00", b"\xc1", b"not msgpack at all", b"\xff" * 64,
        valid[: len(valid) // 2], valid[:1], valid + b"\x00trailing",
        b"\xdd\xff\xff\xff\xff",  # array32 claiming 4 billion items
        b"\xdf\xff\xff\xff\xff",  # map32 claiming 4 billion pairs
        b"\xc6\x7f\xff\xff\xff",  # bin32 claiming 2 GiB
        b"\x91" * 100_000,  # 100,000 nested arrays
        b"\x00" * 900_000,  # near max_payload
        pack([99, Kind.CHUNK, 1, b"x"]), pack({"v": 99}), pack([]), pack({}),
        pack([VERSION]), pack([VERSION, 42]), pack([VERSION, Kind.CHUNK]),
        pack([VERSION, Kind.CHUNK, "one", 5]), pack([VERSION, Kind.DONE, None, "a", [], {}]),
        pack([VERSION, Kind.STATUS, 1, 99, "x", [1, 2], "h"]),
        pack([VERSION, Kind.ERROR, 1, "not a tuple"]),
        pack([VERSION, Kind.ACK, 0, {"x": 1}, "NaN"]), pack([VERSION, Kind.CANCEL, 0]),
        pack([VERSION, Kind.MUX, 0, 5, b"x"]), pack([VERSION, Kind.MUX, 0, "abc"]),
        pack({"v": VERSION, "id": 5}), pack({"v": VERSION, **{k: None for k in "abc"}}),
    ]
    raw = msgpack.unpackb(valid)
    for key, value in (("api", "nope"), ("body", "str"), ("created_ms", "x"),
                       ("window_bytes", 2**63), ("extra", "abc"), ("extra", [1, 2]),
                       ("stream", {"a": 1}), ("model", 5), ("id", None)):
        out.append(pack({**raw, key: value}))
    return out


def _odd_but_decodable() -> list[bytes]:
    """Envelopes that decode and then make no sense for the tier reading them."""
    return [r.encode() for r in (
        _request(model="no-such-model"), _request(deadline_ms=0), _request(created_ms=2**62),
        _request(window_bytes=0, window_msgs=0), _request(window_bytes=-5),
        _request(tenant=">", user="*"), _request(reply="tg.out.nobody.x"),
        _request(extra={"traceparent": "00-zz-zz-zz", "x": "\r\n"}),
        _request(extra={"traceparent": 5, "tracestate": [1], "baggage": {"a": None}}),
        _request(id="", reply="tg.req.interactive.x"), _request(reply="$KV.TG_KEYS.x"),
        _request(mux="tg.job.tidegate-sim"),
        _request(api=Api.COMPLETIONS, body={"prompt": 5}),
        _request(body={"messages": "not a list", "max_tokens": -1}),
    )]


async def _stream(pipeline: Pipeline) -> tuple[bytes, str]:
    status, body = await asyncio.to_thread(pipeline.post, CHAT, BODY)
    assert status == 200, body[:300]
    return body, ""


def _text(sse: bytes) -> str:
    out = []
    for line in sse.split(b"\n"):
        if line.startswith(b"data: {"):
            for choice in json.loads(line[6:]).get("choices", []):
                out.append(choice.get("delta", {}).get("content") or "")
    return "".join(out)


async def _worker_ids(js: Any, pipeline: Pipeline) -> list[str]:
    kv = await js.key_value(pipeline.config.nats.subjects.workers_bucket)
    return list(await snapshot(kv))


def _bad_count(metrics: str) -> float:
    return sum(float(m) for m in re.findall(
        r"^tidegate_broker_bad_messages_total\{[^}]*\} ([0-9.e+]+)$", metrics, re.M))


async def test_every_tier_survives_garbage_on_every_subject(pipeline: Pipeline) -> None:
    before = _text((await _stream(pipeline))[0])
    assert before
    nc = NATS()
    await nc.connect(pipeline.config.nats.url)
    try:
        js = broker.jetstream(nc, pipeline.config.nats)
        subjects = pipeline.config.nats.subjects
        model = encode_token("tidegate-sim")
        garbage = _garbage_envelopes()
        odd = _odd_but_decodable()
        workers = await _worker_ids(js, pipeline)
        assert workers
        core = [subjects.out(EDGE_ID, secrets.token_hex(12)), subjects.edge_mux(EDGE_ID),
                *[subjects.control(w) for w in workers]]
        for data in garbage:
            for subject in core:
                await nc.publish(subject, data)
            # The dispatchers' desk, asked (a reply subject) and told.
            await nc.publish(subjects.desk, data, reply=nc.new_inbox())
            await nc.publish(subjects.desk, data)
            for subject in (subjects.request("interactive", "fuzz"), f"tg.job.{model}",
                            f"tg.usage.{model}"):
                await js.publish(subject, data)
        for data in odd:
            await js.publish(subjects.request("interactive", "fuzz"), data)
            await js.publish(f"tg.job.{model}", data)
        # A Chunk, Heartbeat and Done for sessions that do not exist, in a mux too.
        for message in (Chunk(1, b"data: {}\n\n"), Heartbeat(1), Done(1, 1, 1, "stop")):
            await nc.publish(subjects.out(EDGE_ID, secrets.token_hex(12)), message.encode())
        mux = msgpack.packb([VERSION, Kind.MUX, 0, secrets.token_hex(12),
                             Done(1, 1, 1, "stop").encode(), "x", b"\xc1"])
        await nc.publish(subjects.edge_mux(EDGE_ID), mux)
        # Control-plane buckets: undecodable records.
        for bucket, key in ((subjects.keys_bucket, "0" * 64), (subjects.keys_bucket, "notahash"),
                            (subjects.policies_bucket, "tenant.fuzz"),
                            (subjects.workers_bucket, "ghost-worker"),
                            (subjects.cancels_bucket, secrets.token_hex(12))):
            kv = await js.key_value(bucket)
            for data in (b"\xc1", b"{", b'{"tenant": 5}', b"[]", b"\x00" * 1000):
                await kv.put(key, data)
        await nc.flush()

        # A real stream, and then its Done replayed (and a Chunk) after it ended.
        status, body = await asyncio.to_thread(pipeline.post, CHAT, BODY)
        assert status == 200
        assert _text(body) == before
    finally:
        await nc.close()

    # Every tier still runs and serves the same answer, repeatedly.
    for _ in range(3):
        assert _text((await _stream(pipeline))[0]) == before
    for process in pipeline.processes:
        assert process.running, process.describe_failure(process.name)
    # Each tier counted what it dropped (edge: session/mux; dispatcher:
    # requests/usage; worker: jobs/control).
    for name in ("edge", "dispatcher", "worker0"):
        deadline = time.monotonic() + 15
        while _bad_count(await asyncio.to_thread(pipeline.scrape, name)) == 0:
            assert time.monotonic() < deadline, f"{name} counted no bad message"
            await asyncio.sleep(0.2)
    # ...and logged it at a rate limit, not once per message.
    edge_log = pipeline.edge.log_tail(400)
    assert 0 < edge_log.count("dropped a bad message") < len(garbage)


async def test_replayed_messages_for_a_finished_stream_are_dropped(pipeline: Pipeline) -> None:
    nc = NATS()
    await nc.connect(pipeline.config.nats.url)
    seen: list[tuple[str, bytes]] = []

    async def record(msg: Any) -> None:
        seen.append((msg.subject, msg.data))

    try:
        await nc.subscribe(f"tg.out.{EDGE_ID}.*", cb=record)
        before = _text((await _stream(pipeline))[0])
        await nc.flush()
        assert seen, "the test's subscription saw the stream's messages"
        # Replay the whole finished stream (Head, Chunks, Done) on its subjects.
        for subject, data in list(seen):
            await nc.publish(subject, data)
        await nc.flush()
        assert _text((await _stream(pipeline))[0]) == before
    finally:
        await nc.close()
    assert pipeline.edge.running
