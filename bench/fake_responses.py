"""The fake backend's ``POST /v1/responses`` and ``POST /v1/embeddings``.

Same pacing, records and faults as the chat endpoints, in vLLM's and OpenAI's
shapes: Responses events with ``sequence_number`` from 0 ending with
``response.completed`` (no ``data: [DONE]``; ``x-fake-no-seq: 1`` drops the
numbers, as llama-server does), the response object when not streaming, and a
deterministic vector per embeddings input (``dimensions``, default 8; float or
base64). Usage is characters / 4. ``FakeConfig(responses=False)`` /
``embeddings=False`` leaves the path unrouted (404), as a backend without it.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import json
import struct
import time
from collections.abc import Mapping
from typing import Any

from aiohttp import web

from bench.fake_records import FakeHost, FakeRecord, _Faults
from tidegate.apis.responses import DIALECT as RESPONSES
from workers.backends.greedy import greedy_plan

__all__ = ["answer_embeddings", "answer_responses"]


def _json(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()


def input_tokens(body: Mapping[str, Any]) -> int:
    """The fake's prompt-token count of a Responses or embeddings body."""
    chars = 0
    value = body.get("input")
    items = value if isinstance(value, list) else [value]
    for item in items:
        if isinstance(item, str):
            chars += len(item)
        elif isinstance(item, int):
            chars += 4
        elif isinstance(item, list):
            chars += 4 * len(item)
        elif isinstance(item, Mapping):
            content = item.get("content")
            if isinstance(content, str):
                chars += len(content)
            for part in content if isinstance(content, list) else ():
                if isinstance(part, Mapping) and isinstance(part.get("text"), str):
                    chars += len(part["text"])
    if isinstance(body.get("instructions"), str):
        chars += len(body["instructions"])
    return (chars + 3) // 4


def _response(rid: str, model: Any, status: str, output: list[Any],
              usage: dict[str, Any] | None) -> dict[str, Any]:
    return {"id": rid, "object": "response", "created_at": int(time.time()), "status": status,
            "error": None, "incomplete_details": None, "model": model, "output": output,
            "parallel_tool_calls": True, "tool_choice": "auto", "tools": [], "usage": usage}


def _item(mid: str, status: str, text: str | None) -> dict[str, Any]:
    content = [] if text is None else [{"type": "output_text", "text": text, "annotations": []}]
    return {"id": mid, "type": "message", "status": status, "role": "assistant",
            "content": content}


async def answer_responses(fake: FakeHost, request: web.Request, record: FakeRecord,
                           body: dict[str, Any], faults: _Faults) -> web.StreamResponse:
    model = body.get("model")
    if body.get("input") is None:
        return fake._error(record, 400, "input: field required")
    cfg = fake.config
    limit = body.get("max_output_tokens")
    n = cfg.tokens if limit is None else max(0, min(int(limit), cfg.tokens))
    ttft = cfg.ttft if faults.ttft is None else faults.ttft
    itl = cfg.itl if faults.itl is None else faults.itl
    rid, mid = f"resp_fake{record.id}", f"msg_fake{record.id}"
    if cfg.deterministic:  # the greedy model's text, a trailing assistant item continued
        plan = greedy_plan(True, RESPONSES.chat_body(body) or {}, None if limit is None
                           else int(limit), cfg.tokens)
        pieces, n = list(plan), len(plan)
    else:
        pieces = [fake._texts[i % 26] for i in range(n)]
    text = "".join(pieces)
    prompt = input_tokens(body)
    usage = {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": 0},
             "output_tokens": n, "output_tokens_details": {"reasoning_tokens": 0},
             "total_tokens": prompt + n}
    final = _response(rid, model, "completed", [_item(mid, "completed", text)], usage)
    if not body.get("stream"):
        await asyncio.sleep(ttft + itl * max(n - 1, 0))
        data = _json(final)
        record.bytes_written = len(data)
        if cfg.keep_output:
            record.output += data
        record.completed = True
        return web.Response(body=data, content_type="application/json")

    no_seq = bool(request.headers.get("x-fake-no-seq") or body.get("fake_no_seq"))
    seq = 0

    def event(kind: str, fields: dict[str, Any]) -> bytes:
        nonlocal seq
        head: dict[str, Any] = {"type": kind} if no_seq else {"type": kind,
                                                              "sequence_number": seq}
        seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + _json({**head, **fields}) + b"\n\n"

    ident = {"item_id": mid, "output_index": 0, "content_index": 0}
    part = {"type": "output_text", "text": "", "annotations": []}
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                       "Cache-Control": "no-cache"})
    await resp.prepare(request)
    batches: list[list[bytes]] = [[
        event("response.created", {"response": _response(rid, model, "in_progress", [], None)}),
        event("response.in_progress", {"response": _response(rid, model, "in_progress", [],
                                                             None)}),
        event("response.output_item.added", {"output_index": 0,
                                             "item": _item(mid, "in_progress", None)}),
        event("response.content_part.added", {**ident, "part": part})]]
    for piece in pieces:
        batches.append([event("response.output_text.delta", {**ident, "delta": piece})])
    batches[-1] += [
        event("response.output_text.done", {**ident, "text": text}),
        event("response.content_part.done", {**ident, "part": {**part, "text": text}}),
        event("response.output_item.done", {"output_index": 0,
                                            "item": _item(mid, "completed", text)}),
        event("response.completed", {"response": final})]
    start = time.monotonic() + ttft
    for i, batch in enumerate(batches):
        delay = start + max(i - 1, 0) * itl - time.monotonic()
        if i and delay > 0:
            await asyncio.sleep(delay)
        for data in batch:
            if record.events_written == faults.fail_after:
                record.dropped = True
                if request.transport is not None:
                    request.transport.close()
                return resp
            await fake._write(resp, record, data)
    record.completed = True
    with contextlib.suppress(ConnectionError):
        await resp.write_eof()
    return resp


def vector(item: Any, dimensions: int) -> list[float]:
    """The fake's deterministic vector for one input: float32 values in [-1, 1)."""
    out: list[float] = []
    counter = 0
    while len(out) < dimensions:
        digest = hashlib.blake2b(_json([item, counter]), digest_size=64).digest()
        out += [(v - 32768) / 32768 for v in struct.unpack("<32H", digest)]
        counter += 1
    return out[:dimensions]


async def answer_embeddings(fake: FakeHost, request: web.Request, record: FakeRecord,
                            body: dict[str, Any], faults: _Faults) -> web.StreamResponse:
    value = body.get("input")
    if value is None:
        return fake._error(record, 400, "input: field required")
    if isinstance(value, list) and value and not all(isinstance(v, int) for v in value):
        items = value
    else:
        items = [value]
    dims = body.get("dimensions")
    dimensions = dims if isinstance(dims, int) and 0 < dims <= 4096 else 8
    b64 = body.get("encoding_format") == "base64"
    data = []
    for index, item in enumerate(items):
        values = vector(item, dimensions)
        encoded: Any = (base64.b64encode(struct.pack(f"<{dimensions}f", *values)).decode()
                        if b64 else values)
        data.append({"object": "embedding", "index": index, "embedding": encoded})
    tokens = input_tokens(body)
    await asyncio.sleep(fake.config.ttft if faults.ttft is None else faults.ttft)
    payload = _json({"object": "list", "data": data, "model": body.get("model"),
                     "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})
    record.bytes_written = len(payload)
    if fake.config.keep_output:
        record.output += payload
    record.completed = True
    return web.Response(body=payload, content_type="application/json")
