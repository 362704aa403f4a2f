"""The fake backend's Anthropic ``POST /v1/messages`` and its chat tool calls.

Same pacing, records and faults as the chat endpoints. ``/v1/messages``
streams Anthropic's events in Anthropic's order (usage: prompt characters / 4
in, tokens sent out), or answers the message object; ``FakeConfig(messages=False)``
leaves the path unrouted, as a chat-only server. With
``FakeConfig(tool_calls=True)`` (or the body's ``fake_tool_call``), a chat request
offering ``tools`` whose last message is not a tool result gets one call of the
first (or the chosen) tool, its arguments streamed four characters per token;
a tool result gets text, so a client's tool loop ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Mapping
from typing import Any

from aiohttp import web

from bench.fake_records import FakeHost, FakeRecord, _Faults

__all__ = ["answer_messages", "answer_tool_call", "wants_tool_call"]


def _json(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()


def _event(kind: str, fields: dict[str, Any]) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + _json({"type": kind, **fields}) + b"\n\n"


def input_tokens(body: Mapping[str, Any]) -> int:
    """The fake's prompt-token count of a Messages body: text characters / 4."""
    chars = len(body["system"]) if isinstance(body.get("system"), str) else 0
    for turn in body.get("messages") or ():
        content = turn.get("content") if isinstance(turn, Mapping) else None
        if isinstance(content, str):
            chars += len(content)
        for block in content if isinstance(content, list) else ():
            if isinstance(block, Mapping) and isinstance(block.get("text"), str):
                chars += len(block["text"])
    return (chars + 3) // 4


async def _paced(fake: FakeHost, request: web.Request, record: FakeRecord,
                 faults: _Faults, batches: list[list[bytes]]) -> web.StreamResponse:
    """Write ``batches`` as a stream: the first after TTFT, then one per ITL."""
    cfg = fake.config
    ttft = cfg.ttft if faults.ttft is None else faults.ttft
    itl = cfg.itl if faults.itl is None else faults.itl
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                       "Cache-Control": "no-cache"})
    await resp.prepare(request)
    start = time.monotonic() + ttft
    for i, batch in enumerate(batches):
        delay = start + max(i - 1, 0) * itl - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        for data in batch:
            if record.events_written == faults.fail_after:
                record.dropped = True
                if request.transport is not None:
                    request.transport.close()
                return resp
            await fake._write(resp, record, data)
        if record.first_byte_at is None:
            record.first_byte_at = time.monotonic()
    record.completed = True
    with contextlib.suppress(ConnectionError):
        await resp.write_eof()
    return resp


async def answer_messages(fake: FakeHost, request: web.Request, record: FakeRecord,
                          body: dict[str, Any], faults: _Faults) -> web.StreamResponse:
    if not isinstance(body.get("messages"), list) or not isinstance(body.get("max_tokens"), int):
        return fake._error(record, 400, "messages and max_tokens: field required")
    cfg = fake.config
    n = max(0, min(int(body["max_tokens"]), cfg.tokens))
    reason = "max_tokens" if int(body["max_tokens"]) <= cfg.tokens else "end_turn"
    pieces = [fake._texts[i % 26] for i in range(n)]
    mid = f"msg_fake{record.id}"
    prompt = input_tokens(body)
    message: dict[str, Any] = {"id": mid, "type": "message", "role": "assistant",
                               "model": body.get("model"), "content": [],
                               "stop_reason": None, "stop_sequence": None,
                               "usage": {"input_tokens": prompt, "output_tokens": 1}}
    if not body.get("stream"):
        await asyncio.sleep(cfg.ttft + cfg.itl * max(n - 1, 0))
        final = {**message, "content": [{"type": "text", "text": "".join(pieces)}],
                 "stop_reason": reason, "usage": {"input_tokens": prompt, "output_tokens": n}}
        data = _json(final)
        record.bytes_written = len(data)
        if cfg.keep_output:
            record.output += data
        record.completed = True
        return web.Response(body=data, content_type="application/json")
    batches: list[list[bytes]] = [[
        _event("message_start", {"message": message}),
        _event("content_block_start", {"index": 0, "content_block": {"type": "text",
                                                                     "text": ""}}),
        _event("ping", {})]]
    for piece in pieces:
        batches.append([_event("content_block_delta", {
            "index": 0, "delta": {"type": "text_delta", "text": piece}})])
    batches[-1] += [
        _event("content_block_stop", {"index": 0}),
        _event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": None},
                                 "usage": {"output_tokens": n}}),
        _event("message_stop", {})]
    return await _paced(fake, request, record, faults, batches)


def wants_tool_call(fake: FakeHost, body: Mapping[str, Any]) -> bool:
    """Whether a chat request is answered with a tool call (module docstring)."""
    messages = body.get("messages")
    last = messages[-1] if isinstance(messages, list) and messages else None
    return (bool(body.get("tools")) and (fake.config.tool_calls or bool(body.get("fake_tool_call")))
            and body.get("tool_choice") != "none"
            and not (isinstance(last, Mapping) and last.get("role") == "tool"))


async def answer_tool_call(fake: FakeHost, request: web.Request, record: FakeRecord,
                           body: dict[str, Any], faults: _Faults) -> web.StreamResponse:
    tools = body["tools"]
    choice = body.get("tool_choice")
    forced = choice.get("function") if isinstance(choice, Mapping) else None
    name = forced.get("name") if isinstance(forced, Mapping) else tools[0]["function"]["name"]
    letters = "".join(fake._texts[i % 26].strip() for i in range(3))
    arguments = _json({"query": letters}).decode()
    parts = [arguments[i:i + 4] for i in range(0, len(arguments), 4)]
    call_id = f"call_fake{record.id}"
    prompt = (sum(len(str(m.get("content") or "")) for m in body["messages"]
                  if isinstance(m, Mapping)) + 3) // 4
    usage = {"prompt_tokens": prompt, "completion_tokens": len(parts),
             "total_tokens": prompt + len(parts)}
    head = {"id": f"chatcmpl-fake{record.id}", "created": int(time.time()),
            "model": body.get("model")}
    if not body.get("stream"):
        await asyncio.sleep(fake.config.ttft)
        data = _json({**head, "object": "chat.completion", "choices": [{
            "index": 0, "message": {"role": "assistant", "content": None, "tool_calls": [{
                "id": call_id, "type": "function",
                "function": {"name": name, "arguments": arguments}}]},
            "finish_reason": "tool_calls"}], "usage": usage})
        record.completed = True
        return web.Response(body=data, content_type="application/json")

    def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
        return b"data: " + _json({**head, "object": "chat.completion.chunk", "choices": [
            {"index": 0, "delta": delta, "finish_reason": finish}]}) + b"\n\n"

    first = {"role": "assistant", "content": None, "tool_calls": [{
        "index": 0, "id": call_id, "type": "function",
        "function": {"name": name, "arguments": ""}}]}
    batches: list[list[bytes]] = [[chunk(first)]]
    for part in parts:
        batches.append([chunk({"tool_calls": [{"index": 0, "function": {"arguments": part}}]})])
    batches[-1] += [chunk({}, "tool_calls"),
                    b"data: " + _json({**head, "object": "chat.completion.chunk", "choices": [],
                                       "usage": usage}) + b"\n\n",
                    b"data: [DONE]\n\n"]
    return await _paced(fake, request, record, faults, batches)
