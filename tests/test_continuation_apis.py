"""Continuation (issue 25, items 3 and 5) over WebSocket generations and the
Responses API: a worker SIGKILLed mid-stream costs the client a pause, not
the answer, and the text is byte-exact against an uninterrupted run (the
simulator's deterministic mode).

Unit: a Responses stream cut at every event boundary, read by the edge
(``Delivered``) and spliced by the worker (``ContinuedResponses``) onto the
simulator's continuation, is the uninterrupted stream; the seam's ids are
renamed when a backend names new ones. Pipeline: real nats-server,
redis-server, an edge, a dispatcher and two workers."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import re
import signal
import time
import uuid
from typing import Any

import aiohttp
import pytest

from edge.continuation import Delivered, continuable, deciding_fields
from tests import test_continuation
from tests.pipeline import DEV_KEY, Pipeline
from tests.test_continuation import killed_then_whole
from tidegate.config import ModelConfig, SimulatorConfig
from tidegate.wire.protocol import Api, Continue, Request, decode_control
from workers.backends.simulator import SimulatorBackend
from workers.continuation import ContinuedResponses, continued, continued_stream

LENGTH = test_continuation.LENGTH  # tokens of each answer (its pipeline's simulator)

SIM = SimulatorConfig(ttft=0.0, tokens_per_second=1e6, length=12, deterministic=True)


def responses_request(**body: Any) -> Request:
    return Request(id="r1", reply="tg.out.e.r1", model="m", api=Api.RESPONSES, stream=True,
                   body={"input": "tell me", "instructions": "be brief", **body},
                   created_ms=1_700_000_000_000, deadline_ms=0, window_bytes=1024,
                   window_msgs=8)


async def read_all(stream: Any) -> bytes:
    out = b""
    while data := await stream.read(1 << 16):
        out += data
    await stream.aclose()
    return out


def events_of(raw: bytes) -> list[bytes]:
    return [e + b"\n\n" for e in raw.split(b"\n\n") if e]


def without_input_usage(raw: bytes) -> bytes:
    """The continuation's prompt holds the delivered text: its input_tokens
    (and total) are its own (the usage log's); everything else must match."""
    return re.sub(rb'"(input|total)_tokens":\d+', rb'"\1_tokens":0', raw)


def test_what_can_be_continued_of_responses() -> None:
    on = ModelConfig(name="m", failover="continue")
    assert continuable(responses_request(), on)
    for body in ({"tools": [{"type": "function", "name": "f"}]}, {"top_logprobs": 2},
                 {"include": ["message.output_text.logprobs"]}):
        assert not continuable(responses_request(**body), on), body
        kept = dataclasses.replace(responses_request(**body),
                                   body=deciding_fields(responses_request(**body).body))
        assert not continuable(kept, on), kept.body
    assert continuable(dataclasses.replace(responses_request(),
                                           body=deciding_fields(responses_request().body)), on)
    # A background response (always resumable) continues in its stream log.
    assert continuable(dataclasses.replace(responses_request(background=True),
                                           resumable=True), on)


def test_the_continued_responses_request() -> None:
    r = continued(responses_request(max_output_tokens=20), "Hello", 3)
    assert r.body["input"] == [{"role": "user", "content": "tell me"},
                               {"role": "assistant", "content": "Hello"}]
    assert (r.body["max_output_tokens"], r.body["instructions"]) == (17, "be brief")
    items = [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]}]
    assert continued(responses_request(input=items), "x", 1).body["input"][:-1] == items
    go = Continue("r1", "Hé", 2, 7, "resp_a", "msg_b", 4)
    assert decode_control(go.encode()) == go
    assert decode_control(Continue("r1", "t", 1).encode()) == Continue("r1", "t", 1)


@pytest.mark.parametrize("limit", [None, 10])
async def test_a_responses_stream_cut_anywhere_is_spliced_byte_exact(limit: int | None) -> None:
    backend = SimulatorBackend(ModelConfig(name="m", simulator=SIM))
    extra = {} if limit is None else {"max_output_tokens": limit}
    request = responses_request(**extra)
    whole = events_of(await read_all(await backend.open(request)))
    assert len(whole) > 10
    # Cut after each event from the first (response.created) to the last delta.
    last_delta = max(i for i, e in enumerate(whole) if b"output_text.delta" in e)
    for cut in range(1, last_delta + 1):
        delivered = Delivered()
        delivered.add(b"".join(whole[:cut]))
        seam = delivered.text(Api.RESPONSES)
        assert seam is not None, whole[cut - 1]
        go = Continue("r1", *seam)
        assert (go.events, go.response_id) == (cut, "resp_r1")
        again = continued(request, go.text, go.tokens)
        stream = continued_stream(await backend.open(again), again, go)
        rest = await read_all(stream)
        assert without_input_usage(b"".join(whole[:cut]) + rest) == \
            without_input_usage(b"".join(whole)), cut


class Replay:
    """A backend stream of fixed events (another backend's ids)."""

    def __init__(self, raw: bytes, size: int) -> None:
        self.raw, self.size, self.usage = raw, size, None

    async def read(self, max_bytes: int) -> bytes:
        out, self.raw = self.raw[:self.size], self.raw[self.size:]
        return out

    async def aclose(self) -> None:
        return None


async def test_a_new_backends_ids_are_renamed_to_the_clients() -> None:
    backend = SimulatorBackend(ModelConfig(name="m", simulator=SIM))
    request = responses_request()
    whole = events_of(await read_all(await backend.open(request)))
    delivered = Delivered()
    delivered.add(b"".join(whole[:6]))
    seam = delivered.text(Api.RESPONSES)
    assert seam is not None
    go = Continue("r1", *seam)
    again = continued(request, go.text, go.tokens)
    other = (await read_all(await backend.open(again))).replace(
        b"resp_r1", b"resp_other").replace(b"msg_r1", b"msg_other")
    for size in (7, 100, 1 << 16):  # whatever the backend's reads cut
        rest = await read_all(ContinuedResponses(Replay(other, size), go, None))  # type: ignore[arg-type]
        assert b"_other" not in rest
        assert without_input_usage(b"".join(whole[:6]) + rest) == \
            without_input_usage(b"".join(whole))


def test_what_a_responses_seam_cannot_continue() -> None:
    created = (b'event: response.created\ndata: {"type":"response.created","sequence_number":0,'
               b'"response":{"id":"resp_1"}}\n\n')
    reasoning = (b'data: {"type":"response.output_item.added","sequence_number":1,'
                 b'"output_index":0,"item":{"id":"rs_1","type":"reasoning"}}\n\n')
    call = (b'data: {"type":"response.function_call_arguments.delta","sequence_number":1,'
            b'"delta":"{"}\n\n')
    for tail in (reasoning, call):
        d = Delivered()
        d.add(created + tail)
        assert d.text(Api.RESPONSES) is None, tail
    d = Delivered()
    d.add(created)
    assert d.text(Api.RESPONSES) == ("", 0, 1, "resp_1", "", 1)


# -- the pipeline ---------------------------------------------------------------------


# test_continuation's: two workers, failover = "continue", the deterministic simulator.
pipeline = test_continuation.pipeline


_IDS = re.compile(rb'"id":"[^"]*","object":"([^"]*)","created":\d+')


def chunk_data(frames: list[dict[str, Any]]) -> list[tuple[int, bytes]]:
    """A generation's chunk frames, (seq, data) with the per-request id and
    timestamp blanked (two runs of one prompt are two requests)."""
    return [(f["seq"], _IDS.sub(rb'"id":"-","object":"\1","created":0',
                                json.dumps(f["data"], separators=(",", ":")).encode()))
            for f in frames if f["type"] == "chunk"]


async def ws_run(session: aiohttp.ClientSession, url: str, texts: list[str],
                 out: dict[str, Any], **body: Any) -> None:
    """Generations of ``texts`` on one socket, at once; ``out[text]`` is
    (frames, longest pause between two frames)."""
    frames: dict[str, list[dict[str, Any]]] = {t: [] for t in texts}
    last: dict[str, float] = {}
    gaps: dict[str, float] = dict.fromkeys(texts, 0.0)
    async with session.ws_connect(url.replace("http", "ws") + "/v1/ws", headers={
            "Authorization": f"Bearer {DEV_KEY}"}) as ws:
        for i, text in enumerate(texts):
            await ws.send_json({"type": "request", "id": str(i), "path": "/v1/chat/completions",
                                "body": {"model": "tidegate-sim", "messages": [
                                    {"role": "user", "content": text}], **body}})
        open_ = set(texts)
        while open_:
            msg = await ws.receive(timeout=60)
            assert msg.type is aiohttp.WSMsgType.TEXT, msg
            frame = json.loads(msg.data)
            if "id" not in frame:
                continue
            text = texts[int(frame["id"])]
            now = time.monotonic()
            if frame["type"] == "chunk" and text in last:
                gaps[text] = max(gaps[text], now - last[text])
            last[text] = now
            frames[text].append(frame)
            if frame["type"] in ("done", "error", "cancelled"):
                open_.discard(text)
    for text in texts:
        out[text] = (frames[text], gaps[text])


@pytest.mark.slow
@pytest.mark.pipeline
async def test_websocket_generations_continue_byte_exact_across_a_worker_kill(
        pipeline: Pipeline) -> None:
    texts = [f"ws-{i}-{uuid.uuid4().hex}" for i in range(24)]
    groups = [texts[i::3] for i in range(3)]  # three sockets of eight generations
    got, whole = await killed_then_whole(pipeline, lambda session, out: [
        ws_run(session, pipeline.url, g, out) for g in groups])
    for t in texts:
        assert got[t][0][-1]["type"] == "done", got[t][0][-1]
    continued = pipeline.log_text().count("continued on another worker")
    assert continued, "no generation ran on the killed worker"
    for t in texts:
        frames, _ = got[t]
        ids = {f["data"]["id"] for f in frames if f["type"] == "chunk"}
        assert len(ids) == 1, ids  # one response id across the seam
        chunks = chunk_data(frames)
        assert [s for s, _ in chunks] == list(range(1, len(chunks) + 1))  # no frame lost
        assert chunks == chunk_data(whole[t][0]), t
        done, expected = frames[-1], whole[t][0][-1]
        assert (done["usage"]["completion_tokens"], done["finish_reason"]) == \
            (expected["usage"]["completion_tokens"], expected["finish_reason"]), done
    pauses = sorted(got[t][1] for t in texts)
    print(f"{continued} generations continued; longest pause per generation: "
          + " ".join(f"{p:.2f}" for p in pauses))


async def responses_run(session: aiohttp.ClientSession, url: str, text: str,
                        out: dict[str, Any], **body: Any) -> None:
    async with session.post(f"{url}/v1/responses", headers={
            "Authorization": f"Bearer {DEV_KEY}"}, json={
            "model": "tidegate-sim", "stream": True, "input": text, **body}) as resp:
        assert resp.status == 200, await resp.text()
        raw = await resp.read()
        # Two runs of one input are two requests: their ids (the simulator's
        # resp_<id>, msg_<id>) and creation times differ, and nothing else may.
        out[text] = re.sub(rb'"created_at":\d+', b'"created_at":0',
                           raw.replace(resp.headers["x-request-id"].encode(), b"-"))


def responses_events(raw: bytes) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in raw.split(b"\n") if line.startswith(b"data: {")]


@pytest.mark.slow
@pytest.mark.pipeline
async def test_responses_streams_continue_byte_exact_across_a_worker_kill(
        pipeline: Pipeline) -> None:
    texts = [f"responses-{i}-{uuid.uuid4().hex}" for i in range(20)]
    got, whole = await killed_then_whole(pipeline, lambda session, out: [
        responses_run(session, pipeline.url, t, out) for t in texts])
    for t in texts:
        assert responses_events(got[t])[-1].get("type") == "response.completed", got[t][-400:]
    continued = pipeline.log_text().count("continued on another worker")
    assert continued, "no stream ran on the killed worker"
    for t in texts:
        raw = got[t].replace(b": ping\n\n", b"")
        events = responses_events(raw)
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        kinds = [e["type"] for e in events]
        for opening in ("response.created", "response.output_item.added"):
            assert kinds.count(opening) == 1, kinds
        assert len({e["item_id"] for e in events if "item_id" in e}) == 1
        usage = events[-1]["response"]["usage"]
        assert usage["output_tokens"] == LENGTH
        # Byte-exact, the input token count aside (the continuation's own).
        assert without_input_usage(raw) == without_input_usage(
            whole[t].replace(b": ping\n\n", b"")), t
    print(f"{continued} Responses streams continued")
    assert continued < len(texts), "every stream ran on the killed worker?"


@pytest.mark.slow
@pytest.mark.pipeline
async def test_what_cannot_be_continued_still_ends_with_worker_lost(
        pipeline: Pipeline) -> None:
    """logprobs over WebSocket and tools on a Responses stream cannot be
    continued from the text: on the killed worker they end with the
    documented retryable worker_lost."""
    texts = [f"lost-{i}-{uuid.uuid4().hex}" for i in range(6)]
    inputs = [f"lost-r-{i}-{uuid.uuid4().hex}" for i in range(6)]
    ws_got: dict[str, Any] = {}
    raw: dict[str, bytes] = {}
    other = pipeline.workers[1].pid
    assert other is not None
    async with aiohttp.ClientSession() as session:
        os.kill(other, signal.SIGSTOP)  # every stream starts on worker 0
        try:
            await asyncio.sleep(3.0)  # its pull requests expire (worker.fetch_timeout 1 s)
            tasks = [asyncio.ensure_future(ws_run(session, pipeline.url, texts, ws_got,
                                                  logprobs=True))]
            tasks += [asyncio.ensure_future(responses_run(
                session, pipeline.url, t, raw,
                tools=[{"type": "function", "name": "f", "parameters": {}}])) for t in inputs]
            await asyncio.sleep(1.0)
        finally:
            os.kill(other, signal.SIGCONT)
        pipeline.workers[0].kill()
        await asyncio.wait_for(asyncio.gather(*tasks), 120)
    for t in texts:
        end = ws_got[t][0][-1]
        assert end["type"] == "error", end
        assert (end["error"]["code"], end["error"]["retryable"]) == ("worker_lost", True)
    for t in inputs:
        last = raw[t].rstrip().rsplit(b"\n", 1)[-1]
        error = json.loads(last.removeprefix(b"data: "))
        error = error.get("error", error)
        assert error["code"] == "worker_lost", last
    assert "continued on another worker" not in pipeline.log_text()


# A limit below the answer's length (LENGTH): the stream ends on it, with
# "length", after about two thirds more than the kill's first second delivered.
LIMIT = 200


def _tokens(api: Api, raw: bytes) -> tuple[int, int | None, str]:
    """(content events, the usage's output tokens or None, the finish reason
    or the error's code) of one stream's raw bytes. The simulator writes one
    token per content event."""
    events = responses_events(raw)
    if api is Api.RESPONSES:
        deltas = sum(e.get("type") == "response.output_text.delta" for e in events)
        end = events[-1]
        if end.get("type") not in ("response.completed", "response.incomplete"):
            return deltas, None, str(end.get("error", end))
        return deltas, end["response"]["usage"]["output_tokens"], \
            str(end["response"]["incomplete_details"] or end["response"]["status"])
    if api is Api.MESSAGES:
        deltas = sum(e.get("type") == "content_block_delta" for e in events)
        ends = [e for e in events if e.get("type") in ("message_delta", "error")]
        if not ends or ends[-1]["type"] == "error":
            return deltas, None, str(events[-1].get("error", events[-1]))
        return deltas, ends[-1]["usage"]["output_tokens"], ends[-1]["delta"]["stop_reason"]
    field = "text" if api is Api.COMPLETIONS else "content"
    choices = [c for e in events for c in e.get("choices", ())]
    deltas = sum(bool(c.get("delta", c).get(field)) for c in choices)
    usage = [e["usage"] for e in events if e.get("usage")]
    finish = [c["finish_reason"] for c in choices if c.get("finish_reason")]
    if not finish:
        return deltas, None, str(events[-1].get("error", events[-1]))
    return deltas, usage[-1]["completion_tokens"] if usage else None, finish[-1]


_LIMITED: dict[str, tuple[Api, str, dict[str, Any]]] = {
    "chat-max_tokens": (Api.CHAT, "/v1/chat/completions", {"max_tokens": LIMIT}),
    "chat-max_completion_tokens": (Api.CHAT, "/v1/chat/completions",
                                   {"max_completion_tokens": LIMIT}),
    "completions-max_tokens": (Api.COMPLETIONS, "/v1/completions", {"max_tokens": LIMIT}),
    "responses-max_output_tokens": (Api.RESPONSES, "/v1/responses",
                                    {"max_output_tokens": LIMIT}),
    "messages-max_tokens": (Api.MESSAGES, "/v1/messages", {"max_tokens": LIMIT}),
}


async def limited_run(session: aiohttp.ClientSession, url: str, text: str,
                      out: dict[str, Any]) -> None:
    """One stream of ``text`` (``<kind>/<n>/<uuid>``, a key of _LIMITED first)
    with its limit; ``out[text]`` is (its request id, its raw bytes)."""
    api, path, limit = _LIMITED[text.split("/", 1)[0]]
    body: dict[str, Any] = {"model": "tidegate-sim", "stream": True, **limit}
    if api is Api.RESPONSES:
        body["input"] = text
    elif api is Api.COMPLETIONS:
        body["prompt"] = text
    else:
        body["messages"] = [{"role": "user", "content": text}]
    if api in (Api.CHAT, Api.COMPLETIONS):
        body["stream_options"] = {"include_usage": True}
    async with session.post(f"{url}{path}", json=body, headers={
            "Authorization": f"Bearer {DEV_KEY}", "x-api-key": DEV_KEY,
            "anthropic-version": "2023-06-01"}) as resp:
        assert resp.status == 200, await resp.text()
        out[text] = (resp.headers["x-request-id"],
                     (await resp.read()).replace(b": ping\n\n", b""))


@pytest.mark.slow
@pytest.mark.pipeline
async def test_a_continued_stream_delivers_its_limit_and_not_a_token_more(
        pipeline: Pipeline) -> None:
    """Streams with a token limit below the answer's length (every API's name
    for it), worker 0 SIGKILLed a second in: a continued one ends on its limit
    with "length" as an uninterrupted one does, the tokens the client read and
    its usage both the limit (the continuation asks the backend for the limit
    less the delivered tokens, workers/continuation.py). Messages streams are
    not continued (edge/continuation.py ``continuable``): one on the killed
    worker ends with an error, having delivered less than its limit."""
    texts = [f"{kind}/{i}/{uuid.uuid4().hex}" for kind in _LIMITED for i in range(6)]
    got, whole = await killed_then_whole(pipeline, lambda session, out: [
        limited_run(session, pipeline.url, t, out) for t in texts])
    logs = pipeline.log_text()
    continued = dict.fromkeys(_LIMITED, 0)
    wrong = []
    for t in texts:
        kind = t.split("/", 1)[0]
        api = _LIMITED[kind][0]
        rid, raw = got[t]
        continued[kind] += f"request {rid} continued on another worker" in logs
        delivered, usage, end = _tokens(api, raw)
        expected = _tokens(api, whole[t][1])
        assert expected[:2] == (LIMIT, LIMIT), (t, expected)
        if api is Api.MESSAGES and usage is None:
            assert delivered < LIMIT, (t, delivered, end)
            continue
        if (delivered, usage, end) != expected:
            wrong.append((t, delivered, usage, end))
    print("continued streams per limit:", continued)
    assert sum(continued.values()), "no stream ran on the killed worker"
    assert not wrong, (sorted({t.split("/", 1)[0] for t, *_ in wrong}), wrong)
