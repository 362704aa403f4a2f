"""Continuation (issue 25, items 3 and 5): a stream whose worker is SIGKILLed
mid-stream goes on on another worker from the text already delivered, and
is byte-exact against an uninterrupted run (the simulator's deterministic
mode: token i = f(prompt, i), a trailing assistant prefix continued).

Unit: the edge's extraction of the delivered text, the worker's continued
request and its stream that drops the repeated opening."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import re
import signal
import statistics
import uuid
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import nats
import nats.errors
import nats.js.errors
import pytest

from edge.continuation import FOLD_AT, Delivered, continuable, deciding_fields
from tests.pipeline import DEV_KEY, Pipeline, stream
from tests.poll import eventually
from tidegate.config import ModelConfig
from tidegate.wire import streamlog
from tidegate.wire.delivered import sse_events
from tidegate.wire.protocol import Api, Continue, Head, Request, decode_control
from workers.continuation import ContinuedStream, closing, continued, continued_stream, spent

LENGTH = 300  # tokens of each answer, at 100 tokens/s: 3 s streams


def request(api: Api = Api.CHAT, **body: Any) -> Request:
    base: dict[str, Any] = ({"messages": [{"role": "user", "content": "hi"}]} if api is Api.CHAT
                            else {"prompt": "once"})
    return Request(id="r1", reply="tg.out.e.r1", model="m", api=api, stream=True,
                   body={**base, **body}, created_ms=0, deadline_ms=0, window_bytes=1024,
                   window_msgs=8)


def test_what_can_be_continued() -> None:
    on = ModelConfig(name="m", failover="continue")
    assert continuable(request(), on)
    assert continuable(request(Api.COMPLETIONS), on)
    assert continuable(request(), ModelConfig(name="m"))  # the shipped default
    assert not continuable(request(), ModelConfig(name="m", failover="restart"))
    assert not continuable(request(), ModelConfig(name="m", failover="off"))
    for body in ({"n": 2}, {"logprobs": True}, {"tools": [{"type": "function"}]},
                 {"top_logprobs": 2}):
        assert not continuable(request(**body), on), body
    # The relay's copy of the request keeps only the deciding flags.
    for body in ({"n": 2}, {"logprobs": True}, {"tools": [{"type": "function"}]}):
        kept = dataclasses.replace(request(**body), body=deciding_fields(request(**body).body))
        assert not continuable(kept, on), kept.body
    assert continuable(dataclasses.replace(request(), body=deciding_fields(request().body)), on)
    assert continuable(request(Api.RESPONSES), on)  # tests/test_continuation_apis.py
    # A resumable one continues in its stream log, a Responses stream's too.
    assert continuable(dataclasses.replace(request(), resumable=True), on)
    assert continuable(dataclasses.replace(request(Api.RESPONSES), resumable=True), on)
    assert not continuable(dataclasses.replace(request(), stream=False), on)


def test_the_edge_reads_the_delivered_text_once_at_failover() -> None:
    d = Delivered()
    d.add(b'data: {"id":"x","choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}'
          b'\n\ndata: {"id":"x","choices":[{"index":0,"delta":{"content":"Hel"}}]}\n\n')
    d.add(b'data: {"id":"x","choices":[{"index":0,"delta":{"content":"lo \\u00e9"}}]}\n\n')
    assert d.text(Api.CHAT) == ("Hello \u00e9", 2, 0, "x"), "with the response id seen"
    tool = Delivered()
    tool.add(b'data: {"choices":[{"index":0,"delta":{"tool_calls":[{"index":0}]}}]}\n\n')
    assert tool.text(Api.CHAT) is None, "a half-written tool call is not continued"
    two = Delivered()
    two.add(b'data: {"choices":[{"index":0,"delta":{}},{"index":1,"delta":{}}]}\n\n')
    assert two.text(Api.CHAT) is None


def test_the_sse_events_of_written_chunks() -> None:
    assert sse_events([b'data: {"a":1}\n\n: ping\n\ndata: [DONE]\n\n',
                       b'data:{"b":2}\n\n']) == [{"a": 1}, {"b": 2}]
    assert sse_events([]) == []
    assert sse_events([b'data: {"a":\n\n']) is None, "a cut event"
    assert sse_events([b'data: {"a":1},{"b":2}\n\n']) is None, "two values on one line"


def test_a_long_stream_is_kept_as_its_text_not_its_chunks() -> None:
    """Past FOLD_AT bytes the kept chunks fold into their text: what a
    failover reads is the same, and the edge holds about the text."""
    def chunk(i: int) -> bytes:
        return (b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,'
                b'"model":"m","choices":[{"index":0,"delta":{"content":"w%d "},'
                b'"finish_reason":null}]}\n\n' % i)

    n = 3 * FOLD_AT // len(chunk(0))
    d = Delivered(Api.CHAT)
    for i in range(n):
        d.add(chunk(i))
    expected = "".join(f"w{i} " for i in range(n))
    assert d.text(Api.CHAT) == (expected, n, 0, "chatcmpl-1")
    assert d.folded, "it folded"
    assert d.size <= FOLD_AT
    kept = d.size + sum(len(t) for t in d.folded)
    assert kept < len(expected) + FOLD_AT < n * len(chunk(0)) / 2
    tool = Delivered(Api.CHAT)
    tool.add(b'data: {"choices":[{"index":0,"delta":{"tool_calls":[{"index":0}]}}]}\n\n')
    for i in range(n):
        tool.add(chunk(i))
    assert tool.text(Api.CHAT) is None, "a folded tool call is still not continued"
    assert (tool.parts, tool.size) == ([], 0), "and nothing more is kept for it"
    responses = Delivered(Api.RESPONSES)
    for i in range(n):
        responses.add(chunk(i))
    assert not responses.folded, "a Responses stream's seam is more than text: kept whole"


def test_the_continued_request_and_the_control_message() -> None:
    r = continued(request(max_tokens=50, stop=["\n"]), "Hello", 3)
    assert r.body["messages"][-1] == {"role": "assistant", "content": "Hello"}
    assert (r.body["continue_final_message"], r.body["add_generation_prompt"]) == (True, False)
    assert (r.body["max_tokens"], r.body["stop"]) == (47, ["\n"])
    c = continued(request(Api.COMPLETIONS, max_tokens=2), "Hello", 3)
    assert (c.body["prompt"], c.body["max_tokens"]) == ("onceHello", 1)
    assert decode_control(Continue("r1", "Hé", 2).encode()) == Continue("r1", "Hé", 2)


class Chunks:
    def __init__(self, *parts: bytes) -> None:
        self.parts = list(parts)
        self.usage: Any = None

    async def read(self, max_bytes: int) -> bytes:
        assert isinstance(max_bytes, int), max_bytes  # as a backend needs
        assert max_bytes > 0, max_bytes
        return self.parts.pop(0) if self.parts else b""

    async def aclose(self) -> None:
        return None


async def test_the_continued_stream_drops_the_repeated_opening() -> None:
    role = b'data: {"choices":[{"delta":{"role":"assistant","content":""}}]}\n\n'
    word = b'data: {"choices":[{"delta":{"content":" on"}}]}\n\n'
    s = ContinuedStream(Chunks(role + word, word), chat=True)  # type: ignore[arg-type]
    assert [await s.read(100), await s.read(100), await s.read(100)] == [word, word, b""]
    alone = ContinuedStream(Chunks(role, word), chat=True)  # type: ignore[arg-type]
    assert await alone.read(100) == word


async def test_a_continuation_past_its_limit_writes_only_the_end() -> None:
    """The dead worker sent every token its limit allows and died before the
    last chunk: the next one asks the backend for nothing (its minimum of one
    token would be one too many) and writes the end: the finish chunk with
    the client's id, and the usage chunk counting every token."""
    r = dataclasses.replace(request(max_tokens=3), include_usage=True)
    assert not spent((r, "abc", 2))
    assert spent((r, "abc", 3))
    assert spent((request(max_completion_tokens=2, max_tokens=9), "ab", 2))
    assert not spent((request(), "abc", 50)), "no limit: the backend's own end"
    assert not spent((request(Api.RESPONSES, max_output_tokens=1), "a", 5))
    go = Continue("r1", "abc", 3, 0, "chatcmpl-1")
    assert closing((r, "abc", 2), go) is None
    end = closing((r, "abc", 3), go)
    assert end is not None
    joined = continued_stream(end, continued(r, "abc", 3), go)
    events = sse_events([await joined.read(1 << 16)])
    assert events is not None
    assert [e["id"] for e in events] == ["chatcmpl-1", "chatcmpl-1"]
    assert events[0]["choices"] == [{"index": 0, "delta": {}, "logprobs": None,
                                     "finish_reason": "length"}]
    assert events[1]["usage"]["completion_tokens"] == 3
    assert (joined.usage.completion_tokens, joined.usage.finish_reason) == (3, "length")
    assert await joined.read(1 << 16) == b""


# -- the pipeline ---------------------------------------------------------------------


def overrides(ack_wait: float = 30.0, resume_timeout: float = 5.0) -> dict[str, Any]:
    """Two workers' worth of the deterministic simulator, failover continue;
    the heartbeat limit (40 s) far above what a test waits for."""
    return {
        "session": {"heartbeat_interval": 1.0, "worker_lost_after": 40, "ack_timeout": 60.0},
        "worker": {"ack_wait": ack_wait, "resume_timeout": resume_timeout},
        "edge": {"request_timeout": 300.0},
        "models": [{"name": "tidegate-sim", "failover": "continue", "max_streams": 64,
                    "simulator": {"ttft": 0.05, "tokens_per_second": 100.0, "length": LENGTH,
                                  "deterministic": True}}]}


@pytest.fixture
def pipeline(tmp_path: Path, nats_server: Any, redis_server: Any) -> Iterator[Pipeline]:
    p = Pipeline(tmp_path, nats_server.url, redis_server.url, workers=2, overrides=overrides())
    try:
        p.start()
        yield p
    finally:
        p.stop()


_IDS = re.compile(rb'"id":"[^"]*","object":"([^"]*)","created":\d+')


def normalized(raw: bytes) -> bytes:
    """The stream with its per-request id and timestamp blanked (two runs of
    one prompt are two requests) and its ``: ping`` comments left out (the
    edge writes one when the pause at the seam outlasts a heartbeat, as on
    any silent stream; they are not events)."""
    return _IDS.sub(rb'"id":"-","object":"\1","created":0', raw.replace(b": ping\n\n", b""))


async def run(session: aiohttp.ClientSession, url: str, text: str,
              out: dict[str, Any]) -> None:
    out[text] = await stream(session, url, "tidegate-sim", text)


Runs = Callable[[aiohttp.ClientSession, dict[str, Any]], list[Awaitable[None]]]


async def killed_then_whole(pipeline: Pipeline, runs: Runs) -> tuple[dict[str, Any],
                                                                      dict[str, Any]]:
    """``runs(session, out)`` started, worker 0 SIGKILLed a second in (a third
    of every stream delivered), all awaited; then the same again with nothing
    killed, what each should be. Returns (got, whole), as ``runs`` filled them."""
    got: dict[str, Any] = {}
    whole: dict[str, Any] = {}
    async with aiohttp.ClientSession() as session:
        tasks = [asyncio.ensure_future(r) for r in runs(session, got)]
        await asyncio.sleep(1.0)
        assert not any(t.done() for t in tasks)
        pipeline.workers[0].kill()
        await asyncio.wait_for(asyncio.gather(*tasks), 120)
        await asyncio.wait_for(asyncio.gather(*runs(session, whole)), 120)
    return got, whole


@pytest.mark.slow
@pytest.mark.pipeline
async def test_a_worker_killed_mid_stream_costs_30_streams_a_pause_not_the_answer(
        pipeline: Pipeline) -> None:
    texts = [f"continue-{i}-{uuid.uuid4().hex}" for i in range(30)]
    got, whole = await killed_then_whole(pipeline, lambda session, out: [
        run(session, pipeline.url, t, out) for t in texts])
    logs = pipeline.log_text()
    continued = logs.count("continued on another worker")
    assert continued, "no stream ran on the killed worker"
    for t in texts:
        raw, _ = got[t]
        assert raw.endswith(b"data: [DONE]\n\n"), raw[-300:]
        ids = set(re.findall(rb'"id":"([^"]*)"', raw))
        assert len(ids) == 1, ids  # one response id across the seam
        assert normalized(raw) == normalized(whole[t][0]), t
    pauses = sorted(got[t][1] for t in texts)
    print(f"{continued} streams continued; longest pause per stream: p50 "
          f"{statistics.median(pauses):.3f}s, p99 {pauses[-1]:.3f}s")
    assert pauses[-1] < 10.0, pauses


@pytest.mark.slow
@pytest.mark.pipeline
async def test_a_non_streaming_request_whose_worker_dies_is_answered_whole(
        pipeline: Pipeline) -> None:
    """The client of a non-streaming request has received nothing when its
    worker dies: the job runs again on the other worker and the answer is
    the whole text (the same one, in deterministic mode)."""
    texts = [f"whole-{i}-{uuid.uuid4().hex}" for i in range(8)]

    async def ask(session: aiohttp.ClientSession, text: str) -> tuple[int, Any]:
        async with session.post(f"{pipeline.url}/v1/chat/completions", headers={
                "Authorization": f"Bearer {DEV_KEY}"}, json={
                "model": "tidegate-sim", "messages": [{"role": "user", "content": text}]}) as r:
            return r.status, await r.json()

    async with aiohttp.ClientSession() as session:
        tasks = [asyncio.ensure_future(ask(session, t)) for t in texts]
        await asyncio.sleep(1.0)
        pipeline.workers[0].kill()
        answers = await asyncio.wait_for(asyncio.gather(*tasks), 120)
        again = await asyncio.wait_for(asyncio.gather(*(ask(session, t) for t in texts)), 120)
    assert "restarted on another worker" in pipeline.log_text()
    for (status, body), (_, whole) in zip(answers, again, strict=True):
        assert status == 200, body
        assert body["choices"][0]["message"]["content"] == \
            whole["choices"][0]["message"]["content"]
        assert body["choices"][0]["finish_reason"] == "stop"


@pytest.mark.slow
@pytest.mark.pipeline
async def test_a_stream_that_cannot_be_continued_ends_with_worker_lost(
        pipeline: Pipeline) -> None:
    """logprobs cannot be rebuilt from the text: such a stream on the killed
    worker ends with the documented retryable worker_lost, at once."""
    texts = [f"logprobs-{i}-{uuid.uuid4().hex}" for i in range(10)]
    ends: dict[str, bytes] = {}

    async def ask(session: aiohttp.ClientSession, text: str) -> None:
        async with session.post(f"{pipeline.url}/v1/chat/completions", headers={
                "Authorization": f"Bearer {DEV_KEY}"}, json={
                "model": "tidegate-sim", "stream": True, "logprobs": True,
                "messages": [{"role": "user", "content": text}]}) as resp:
            assert resp.status == 200, await resp.text()
            ends[text] = (await resp.read()).rstrip().rsplit(b"\n", 1)[-1]

    other = pipeline.workers[1].pid
    assert other is not None
    async with aiohttp.ClientSession() as session:
        os.kill(other, signal.SIGSTOP)  # every stream starts on worker 0
        try:
            await asyncio.sleep(3.0)  # its pull requests expire (worker.fetch_timeout 1 s)
            tasks = [asyncio.ensure_future(ask(session, t)) for t in texts]
            await asyncio.sleep(1.0)
        finally:
            os.kill(other, signal.SIGCONT)
        pipeline.workers[0].kill()
        await asyncio.wait_for(asyncio.gather(*tasks), 120)
    lost = [e for e in ends.values() if e != b"data: [DONE]"]
    assert len(lost) == len(texts), pipeline.logs()[-6000:]
    for end in lost:
        error = json.loads(end.removeprefix(b"data: "))["error"]
        assert (error["code"], error["retryable"]) == ("worker_lost", True), error
    assert "continued on another worker" not in pipeline.log_text()


RESUMABLE = {"Authorization": f"Bearer {DEV_KEY}", "X-Tidegate-Resumable": "true"}


def _blocks(raw: bytes) -> list[bytes]:
    """The SSE blocks of ``raw``, without ``: ping`` and the ``retry:`` field
    (each response, a resume's too, opens with one)."""
    raw = re.sub(rb"(?m)^retry: \d+\n", b"", raw.replace(b": ping\n\n", b""))
    return [b for b in raw.split(b"\n\n") if b.strip()]


async def _resumable(session: aiohttp.ClientSession, url: str, text: str,
                     out: dict[str, Any], path: str = "/v1/chat/completions") -> None:
    """A resumable stream read as a client that follows ``event: reconnect``:
    (its request id, its event blocks, ``id:`` lines included, in order,
    every part's, how many times it resumed). ``path``: a chat completion,
    or a Responses stream (``/v1/responses``, ``text`` its input)."""
    resp = await session.post(f"{url}{path}", headers=RESUMABLE, json={
        "model": "tidegate-sim", "stream": True,
        **({"input": text} if path == "/v1/responses"
           else {"messages": [{"role": "user", "content": text}]})})
    assert resp.status == 200, await resp.text()
    rid = resp.headers["x-request-id"]
    got, resumes = _blocks(await resp.read()), 0
    while got[-1].startswith(b"event: reconnect"):
        last = json.loads(got.pop().split(b"data: ", 1)[1])["last_event_id"]
        resumes += 1
        assert resumes < 5, got[-3:]
        async with session.get(f"{url}/v1/streams/{rid}",
                               headers={**RESUMABLE, "Last-Event-ID": str(last)}) as again:
            assert again.status == 200, await again.text()
            got += _blocks(await again.read())
    out[text] = (rid, got, resumes)


def _data(blocks: list[bytes]) -> bytes:
    """The events' data lines, normalized (see :func:`normalized`)."""
    return normalized(b"\n".join(line for b in blocks for line in b.split(b"\n")
                                 if line.startswith(b"data: ")))


@pytest.mark.slow
@pytest.mark.pipeline
async def test_a_resumable_stream_continues_in_its_log_and_its_client_resumes_there(
        pipeline: Pipeline) -> None:
    """Resumable streams (their log is where every reader reads) whose worker
    is SIGKILLed mid-stream: the next worker reads the log and continues its
    text there; the edge sends its client to resume from the last event it
    got. What the client reads across the seam is byte-exact against an
    uninterrupted run, its event ids run 1, 2, 3, ... without a repeat, and a
    replay of the whole log reads the same."""
    texts = [f"resumable-{i}-{uuid.uuid4().hex}" for i in range(12)]
    got, whole = await killed_then_whole(pipeline, lambda session, out: [
        _resumable(session, pipeline.url, t, out) for t in texts])
    continued = [t for t in texts if got[t][2]]
    assert continued, "no stream ran on the killed worker"
    assert pipeline.log_text().count("continues its stream log") >= len(continued)
    async with aiohttp.ClientSession() as session:
        for t in texts:
            rid, blocks, _ = got[t]
            assert blocks[-1] == b"data: [DONE]", blocks[-3:]
            assert _data(blocks) == _data(whole[t][1]), t
            ids = [int(line[4:]) for b in blocks for line in b.split(b"\n")
                   if line.startswith(b"id: ")]
            assert ids == list(range(1, len(ids) + 1)), ids
            async with session.get(f"{pipeline.url}/v1/streams/{rid}",
                                   headers={**RESUMABLE, "Last-Event-ID": "0"}) as replay:
                assert _blocks(await replay.read()) == blocks, t


async def _last_head(js: Any, config: Any, request_id: str) -> str:
    """The control subject of the last Head in ``request_id``'s stream log."""
    stream = streamlog.stream_name(config.nats.subjects)
    subject = streamlog.subject(config.nats.subjects, request_id)
    control, seq = "", 1
    while True:
        try:
            msg = await js.get_msg(stream, seq=seq, subject=subject, next=True)
        except nats.js.errors.NotFoundError:
            return control
        for entry in streamlog.decode_entry(msg.data or b""):
            if isinstance(entry, Head):
                control = entry.control
        seq = (msg.seq or seq) + 1


@pytest.mark.slow
@pytest.mark.pipeline
async def test_a_stream_goes_on_when_its_edge_is_gone_after_handing_its_job_back(
        tmp_path: Path, nats_server: Any, redis_server: Any) -> None:
    """A worker SIGKILLed and the edge that found it dead gone before the
    next worker's Head reached it (a double fault: stopped here with
    SIGSTOP, and its hand-back written into each stream log as it would
    have): the hand-back is the edge's word, the next worker continues the
    log's text without waiting for an edge that cannot answer, and each
    client, resuming on the other edge, reads its whole text byte-exact.
    Before, the next worker waited worker.resume_timeout for the dead edge,
    then did not run, and the readers ended with worker_lost."""
    p = Pipeline(tmp_path / "tiers", nats_server.url, redis_server.url, workers=2, edges=2,
                 overrides=overrides(ack_wait=4.0, resume_timeout=30.0))
    p.start()
    a, b = p.edge_urls
    texts = [f"handback-{i}-{uuid.uuid4().hex}" for i in range(6)]
    stopped = p.edges[0].pid
    assert stopped is not None
    try:
        async with aiohttp.ClientSession() as session:
            got: dict[str, list[bytes]] = {t: [] for t in texts}
            rids: dict[str, str] = {}

            async def read(text: str) -> None:
                resp = await session.post(f"{a}/v1/chat/completions", headers=RESUMABLE, json={
                    "model": "tidegate-sim", "stream": True,
                    "messages": [{"role": "user", "content": text}]})
                rids[text] = resp.headers["x-request-id"]
                raw = b""
                async for chunk in resp.content.iter_any():
                    raw += chunk
                    blocks = raw.split(b"\n\n")
                    got[text], raw = [*got[text], *blocks[:-1]], blocks[-1]

            readers = [asyncio.ensure_future(read(t)) for t in texts]
            await eventually(lambda: all(len(got[t]) >= 5 for t in texts), 60,
                             "every stream under way")
            os.kill(stopped, signal.SIGSTOP)  # edge A: gone for its clients and workers
            p.workers[0].kill()
            nc = await nats.connect(nats_server.url)
            handed = []
            try:
                js = nc.jetstream()

                async def hand_back(text: str) -> None:
                    """What edge A would have written, had it lived on: its
                    probe (tidegate.broker.liveness) found the worker gone."""
                    control = await _last_head(js, p.config, rids[text])
                    for _ in range(2):
                        try:
                            await nc.request(control, b"", timeout=0.5)
                        except nats.errors.NoRespondersError:
                            handed.append(text)
                            await nc.publish(
                                streamlog.subject(p.config.nats.subjects, rids[text]),
                                streamlog.LogHandBack(control).encode())
                            return
                        except nats.errors.TimeoutError:
                            pass

                await asyncio.gather(*(hand_back(t) for t in texts))
                await nc.flush()
            finally:
                await nc.close()
            assert handed, "no stream ran on the killed worker"
            for r in readers:
                r.cancel()
            whole: dict[str, Any] = {}
            for t in texts:  # each client resumes on edge B after its last event
                blocks = _blocks(b"\n\n".join(got[t]) + b"\n\n")
                ids = [int(line[4:]) for bl in blocks for line in bl.split(b"\n")
                       if line.startswith(b"id: ")]
                async with session.get(f"{b}/v1/streams/{rids[t]}", headers={
                        **RESUMABLE, "Last-Event-ID": str(ids[-1])}) as rest:
                    assert rest.status == 200, await rest.text()
                    blocks += _blocks(await asyncio.wait_for(rest.read(), 120))
                got[t] = blocks
            for t in texts:
                await _resumable(session, b, t, whole)
    finally:
        os.kill(stopped, signal.SIGCONT)
        p.stop()
    for t in texts:
        assert got[t][-1] == b"data: [DONE]", (t in handed, got[t][-3:])
        assert _data(got[t]) == _data(whole[t][1]), t
