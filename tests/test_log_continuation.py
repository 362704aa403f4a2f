"""Continuation in the stream log (issue 25, item 3) where the edge cannot
help: a resumable Responses stream (its seam, sequence numbers and ids,
rebuilt from the log), a resumable stream whose client had left when its
worker died, and a background response; and a second delivery no edge
speaks for, while its first worker still runs the job, which must not run.

Every redelivered copy here has no edge's word: it asks the log's last
worker itself whether it still runs the job (``tidegate.broker.liveness.runs``
on the worker's presence subject). Real nats-server, redis-server, an edge,
a dispatcher and two workers; the simulator's deterministic mode, so a
continued text is checked byte-exact against an uninterrupted run."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import nats
import pytest

from fleet.run.servers import NatsServer
from tests.pipeline import DEV_KEY, Pipeline
from tests.poll import eventually
from tests.servers import ServerHandle
from tests.test_continuation import (
    RESUMABLE,
    _blocks,
    _data,
    _resumable,
    killed_then_whole,
    overrides,
)
from tidegate.broker import liveness

LENGTH = 300  # tests.test_continuation's simulator: 3 s answers

@pytest.fixture
def pipeline(tmp_path: Path, nats_server: ServerHandle,
             redis_server: ServerHandle) -> Iterator[Pipeline]:
    p = Pipeline(tmp_path, nats_server.url, redis_server.url, workers=2,
                 overrides=overrides())
    try:
        p.start()
        yield p
    finally:
        p.stop()


@pytest.fixture
def quick_redelivery(tmp_path: Path, nats_server: ServerHandle,
                     redis_server: ServerHandle) -> Iterator[Pipeline]:
    """JetStream redelivers a job 4 s after its worker's last sign, and a
    copy waits 1 s for an edge's word: nobody watches a job whose client
    left, so only its redelivery brings it back."""
    yield from _quick(tmp_path, nats_server.url, redis_server.url)


def _quick(workdir: Path, nats_url: str, redis_url: str) -> Iterator[Pipeline]:
    p = Pipeline(workdir, nats_url, redis_url, workers=2,
                 overrides=overrides(ack_wait=4.0, resume_timeout=1.0))
    try:
        p.start()
        yield p
    finally:
        p.stop()


def _normalized(data: bytes, request_id: str) -> bytes:
    """A Responses stream's data lines as two runs of one input compare:
    the request's id (the simulator's resp_<id>, msg_<id>) and creation
    time blanked, and the input token count (a continuation's prompt holds
    the delivered text) left out."""
    data = re.sub(rb'"created_at":\d+', b'"created_at":0', data.replace(request_id.encode(), b"-"))
    return re.sub(rb'"(input|total)_tokens":\d+', rb'"\1_tokens":0', data)


async def _responses(session: aiohttp.ClientSession, url: str, text: str,
                     out: dict[str, Any]) -> None:
    """A resumable Responses stream read as a client that follows ``event:
    reconnect``: (its request id, its event blocks, how often it resumed)."""
    await _resumable(session, url, text, out, path="/v1/responses")


def _events(blocks: list[bytes]) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for b in blocks for line in b.split(b"\n")
            if line.startswith(b"data: {")]


@pytest.mark.slow
@pytest.mark.pipeline
async def test_a_resumable_responses_stream_continues_in_its_log(pipeline: Pipeline) -> None:
    """Resumable Responses streams whose worker is SIGKILLed mid-stream: the
    next worker rebuilds the seam from the log (the next sequence_number,
    the response and item ids, the opening events the readers have) and
    continues there; the client, sent to resume, reads one stream: one
    response.created, sequence numbers 0, 1, 2, ... and event ids 1, 2, 3,
    ... without a gap or repeat, the whole text byte-exact against an
    uninterrupted run, and a replay of the log reads the same. Before, such
    a stream ended with worker_lost."""
    texts = [f"responses-log-{i}-{uuid.uuid4().hex}" for i in range(10)]
    got, whole = await killed_then_whole(pipeline, lambda session, out: [
        _responses(session, pipeline.url, t, out) for t in texts])
    continued = [t for t in texts if got[t][2]]
    assert continued, "no stream ran on the killed worker"
    assert pipeline.logs().count("continues its stream log") >= len(continued)
    async with aiohttp.ClientSession() as session:
        for t in texts:
            rid, blocks, _ = got[t]
            events = _events(blocks)
            assert events[-1]["type"] == "response.completed", blocks[-2:]
            assert [e["sequence_number"] for e in events] == list(range(len(events)))
            kinds = [e["type"] for e in events]
            assert kinds.count("response.created") == 1, kinds
            assert len({e["item_id"] for e in events if "item_id" in e}) == 1
            assert events[-1]["response"]["usage"]["output_tokens"] == LENGTH
            assert _normalized(_data(blocks), rid) == \
                _normalized(_data(whole[t][1]), whole[t][0]), t
            ids = [int(line[4:]) for b in blocks for line in b.split(b"\n")
                   if line.startswith(b"id: ")]
            assert ids == list(range(1, len(ids) + 1)), ids
            async with session.get(f"{pipeline.url}/v1/streams/{rid}",
                                   headers={**RESUMABLE, "Last-Event-ID": "0"}) as replay:
                assert _blocks(await replay.read()) == blocks, t


@pytest.mark.slow
@pytest.mark.pipeline
async def test_a_stream_whose_client_left_goes_on_when_its_worker_dies(
        quick_redelivery: Pipeline) -> None:
    """Resumable streams whose clients left after a few events (the job
    generates on into the log) and whose worker is then SIGKILLed: no edge
    follows them any more, so nobody hands their jobs back. At the
    redelivery the copy asks the dead worker itself, finds it gone and
    continues the log; each client, resuming after the last event it read,
    gets the whole text byte-exact. Before, the copy did not run and the
    log ended with its readers' worker_lost."""
    p = quick_redelivery
    texts = [f"left-{i}-{uuid.uuid4().hex}" for i in range(8)]
    async with aiohttp.ClientSession() as session:
        got: dict[str, list[bytes]] = {}
        rids: dict[str, str] = {}
        for t in texts:  # read a few events each, then leave
            resp = await session.post(f"{p.url}/v1/chat/completions", headers=RESUMABLE, json={
                "model": "tidegate-sim", "stream": True,
                "messages": [{"role": "user", "content": t}]})
            assert resp.status == 200, await resp.text()
            rids[t], raw = resp.headers["x-request-id"], b""
            while raw.count(b"\n\nid: ") < 4:
                raw += await resp.content.readany()
            got[t] = _blocks(raw.rsplit(b"\n\n", 1)[0] + b"\n\n")
            resp.close()
        p.workers[0].kill()
        for t in texts:
            ids = [int(line[4:]) for b in got[t] for line in b.split(b"\n")
                   if line.startswith(b"id: ")]
            async with session.get(f"{p.url}/v1/streams/{rids[t]}", headers={
                    **RESUMABLE, "Last-Event-ID": str(ids[-1])}) as rest:
                assert rest.status == 200, await rest.text()
                got[t] += _blocks(await asyncio.wait_for(rest.read(), 120))
        whole: dict[str, Any] = {}
        await asyncio.gather(*(_resumable(session, p.url, t, whole) for t in texts))
    logs = p.logs()
    assert "no edge spoke and its first worker" in logs, logs[-4000:]
    for t in texts:
        assert got[t][-1] == b"data: [DONE]", got[t][-3:]
        assert _data(got[t]) == _data(whole[t][1]), t


@pytest.mark.slow
@pytest.mark.pipeline
async def test_a_background_response_completes_when_its_worker_dies_mid_output(
        quick_redelivery: Pipeline) -> None:
    """Background responses (no client reads them) whose worker is SIGKILLed
    mid-output: at the redelivery the copy finds the worker gone and
    continues the log, and each response completes with the whole text,
    byte-exact against an uninterrupted run of its input, its usage
    counting every output token once. Before, it ended failed
    (worker_lost)."""
    p = quick_redelivery
    headers = {"Authorization": f"Bearer {DEV_KEY}"}
    texts = [f"background-{i}-{uuid.uuid4().hex}" for i in range(6)]

    async def create(session: aiohttp.ClientSession, text: str) -> str:
        async with session.post(f"{p.url}/v1/responses", headers=headers, json={
                "model": "tidegate-sim", "input": text, "background": True}) as resp:
            assert resp.status == 200, await resp.text()
            return str((await resp.json())["id"])

    async def final(session: aiohttp.ClientSession, rid: str) -> dict[str, Any]:
        async def done() -> dict[str, Any] | None:
            async with session.get(f"{p.url}/v1/responses/{rid}", headers=headers) as r:
                body: dict[str, Any] = await r.json()
                return body if body.get("status") not in ("queued", "in_progress") else None
        return await eventually(done, 120, f"response {rid} ended", step=0.2)

    async with aiohttp.ClientSession() as session:
        rids = [await create(session, t) for t in texts]
        await asyncio.sleep(1.0)  # a third of each answer generated
        p.workers[0].kill()
        answers = [await final(session, rid) for rid in rids]
        again = [await final(session, await create(session, t)) for t in texts]
    assert "no edge spoke and its first worker" in p.logs()
    for answer, expected in zip(answers, again, strict=True):
        assert answer["status"] == "completed", answer
        text = answer["output"][0]["content"][0]["text"]
        assert text == expected["output"][0]["content"][0]["text"]
        assert answer["usage"]["output_tokens"] == LENGTH, answer["usage"]


@pytest.fixture
def pings_off(tmp_path: Path, redis_server: ServerHandle) -> Iterator[Pipeline]:
    """quick_redelivery's pipeline on a nats-server that never pings its
    clients: a stopped worker keeps its subscriptions however long it stops.
    With tidegate's server pings (fleet.run.nats_sync) they go after
    about 6 s, and a copy redelivered later finds the worker gone."""
    nats_server = NatsServer(tmp_path / "nats-no-pings", ping_interval=None)
    nats_server.start()
    try:
        yield from _quick(tmp_path / "p", nats_server.url, redis_server.url)
    finally:
        nats_server.stop()


@pytest.mark.slow
@pytest.mark.pipeline
async def test_a_second_delivery_nobody_speaks_for_leaves_a_stopped_worker_its_job(
        pings_off: Pipeline) -> None:
    """A resumable stream whose client left, its worker SIGSTOPped past the
    redelivery (alive, its connection open and its subscriptions there, but
    silent: a pause shorter than the server's ping limit, here made longer
    than a redelivery by a server without pings): the copy asks that worker,
    gets no answer from a subscriber that is there, takes it for running the
    job and ends without a trace (no record, no ack, nothing in the log).
    Resumed, the first worker finishes the stream, which reads whole, once.
    Were the copy to run, two workers would write one log."""
    p = pings_off
    other = p.workers[1].pid
    stopped = p.workers[0].pid
    assert other is not None
    assert stopped is not None
    text = f"stopped-{uuid.uuid4().hex}"
    async with aiohttp.ClientSession() as session:
        os.kill(other, signal.SIGSTOP)  # the stream starts on worker 0
        try:
            await asyncio.sleep(3.0)  # worker 1's pull requests expire
            resp = await session.post(f"{p.url}/v1/chat/completions", headers=RESUMABLE, json={
                "model": "tidegate-sim", "stream": True,
                "messages": [{"role": "user", "content": text}]})
            assert resp.status == 200, await resp.text()
            rid, raw = resp.headers["x-request-id"], b""
            while raw.count(b"\n\nid: ") < 4:
                raw += await resp.content.readany()
            resp.close()
        finally:
            os.kill(other, signal.SIGCONT)
        os.kill(stopped, signal.SIGSTOP)
        try:
            await eventually(lambda: "this copy is a second delivery" in p.logs(), 60,
                             "the copy asked the stopped worker")
        finally:
            os.kill(stopped, signal.SIGCONT)
        async with session.get(f"{p.url}/v1/streams/{rid}",
                               headers={**RESUMABLE, "Last-Event-ID": "0"}) as replay:
            blocks = _blocks(await asyncio.wait_for(replay.read(), 120))
        whole: dict[str, Any] = {}
        await _resumable(session, p.url, text, whole)
    assert blocks[-1] == b"data: [DONE]", blocks[-3:]
    assert _data(blocks) == _data(whole[text][1])
    assert "continues its stream log" not in p.logs()


async def test_runs_asks_a_worker_and_takes_silence_for_running(
        nats_server: ServerHandle) -> None:
    """``liveness.runs`` against a real server: a worker's answer is taken
    as given (runs it, ended it, neither), a subscriber that does not answer
    runs the job, and a subject nobody subscribes to is gone once the
    confirmation has passed."""
    nc = await nats.connect(nats_server.url)
    try:
        async def answer(msg: Any) -> None:
            await msg.respond({b"mine": b"1", b"done": b"2"}.get(msg.data, b"0"))

        await nc.subscribe("tg.live.w1", cb=answer)

        async def silent(msg: Any) -> None:
            return None

        await nc.subscribe("tg.live.w2", cb=silent)
        await nc.flush()
        assert await liveness.runs(nc, "tg.live.w1", "mine", 0.05) == liveness.RUNNING
        assert await liveness.runs(nc, "tg.live.w1", "done", 0.05) == liveness.ENDED
        assert await liveness.runs(nc, "tg.live.w1", "other", 0.05) == liveness.GONE
        assert await liveness.runs(nc, "tg.live.w2", "mine", 0.05) == liveness.RUNNING
        assert await liveness.runs(nc, "tg.live.w3", "mine", 0.05) == liveness.GONE
    finally:
        await nc.close()
