"""Anthropic's Messages API, the edges of it: count_tokens, other tenants,
hostile input, the WebSocket path, batches and Claude Code's own traffic
(tests/messages_pipeline.py has the set-up)."""
# ruff: noqa: F811

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any

import aiohttp
import anthropic
import pytest

from bench.fake_backend import FakeBackend

# The shared fixtures are imported, so tests naming them as parameters
# "redefine" them for ruff (F811): that is how pytest finds them.
from tests.messages_pipeline import (  # noqa: F401
    ARGUMENTS,
    BETA,
    CLAUDE_CODE_HEADERS,
    FAKE_TOKENS,
    HELLO,
    SIM,
    WEATHER,
    anthropic_error,
    chat_only,
    claude_code_body,
    client,
    native,
    pipeline,
    post,
    simulated,
)
from tests.pipeline import DEV_KEY, Pipeline, usage_of
from tests.poll import eventually
from tidegate.apis import estimate_prompt_tokens
from tidegate.wire.protocol import Api

pytestmark = pytest.mark.pipeline


# -- count_tokens, other tenants, hostile input -----------------------------------------------


async def test_count_tokens_is_labelled_an_estimate(client: anthropic.AsyncAnthropic) -> None:
    body: dict[str, Any] = {"model": "sim", "system": "Be brief", "messages": HELLO,
                            "tools": [WEATHER]}
    raw = await client.messages.with_raw_response.count_tokens(**body)
    counted = await raw.parse()
    assert counted.input_tokens == estimate_prompt_tokens(Api.MESSAGES, body)
    assert counted.input_tokens > estimate_prompt_tokens(Api.MESSAGES, {**body, "tools": []})
    assert raw.headers["x-tidegate-token-count"] == "estimate"


async def _restricted_key(pipeline: Pipeline, nats_url: str, tenant: str,
                          models: list[str]) -> str:
    import nats

    from tidegate.control.keys import create_key, ensure_keys_bucket

    nc = await nats.connect(nats_url)
    try:
        key, _ = await create_key(await ensure_keys_bucket(nc.jetstream(), pipeline.config),
                                  tenant, models=models)
    finally:
        await nc.close()

    async def known() -> bool:
        status, _, _ = await post(pipeline, {"model": "native", "messages": HELLO},
                                   {"x-api-key": key}, "/v1/messages/count_tokens")
        return status == 200

    await eventually(known, 30, "the new key known to the edge")
    return key


async def test_other_tenant_keys(pipeline: Pipeline, module_nats_url: str) -> None:
    """A key limited to one model may not use another, on either route, nor
    learn it exists (404 not_found_error, as an unknown model); it cannot resume or cancel
    another tenant's Messages stream."""
    key = await _restricted_key(pipeline, module_nats_url, "t" + uuid.uuid4().hex[:8],
                                ["native"])
    for path, body in (("/v1/messages", {"model": "sim", "max_tokens": 5, "messages": HELLO}),
                       ("/v1/messages/count_tokens", {"model": "sim", "messages": HELLO})):
        status, _, answer = await post(pipeline, body, {"x-api-key": key}, path)
        assert status == 404, path
        anthropic_error(answer, "not_found_error")
    # Another tenant's resumable Messages stream is not found for this key.
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{pipeline.url}/v1/messages",
                                headers={"x-api-key": DEV_KEY, "x-tidegate-resumable": "true"},
                                json={"model": "sim", "max_tokens": 5, "messages": HELLO,
                                      "stream": True}) as resp:
            request_id = resp.headers["request-id"]
            assert resp.headers["x-tidegate-resumable"] == "true"
            first = await resp.read()
        # Its owner replays it from the log: the same Anthropic events.
        async with session.get(f"{pipeline.url}/v1/streams/{request_id}",
                               headers={"Authorization": f"Bearer {DEV_KEY}"}) as resp:
            assert resp.status == 200
            replay = await resp.read()
        assert b"event: message_stop" in replay
        assert replay.count(b"event: content_block_delta") == first.count(
            b"event: content_block_delta") == 5
        async with session.get(f"{pipeline.url}/v1/streams/{request_id}",
                               headers={"Authorization": f"Bearer {key}"}) as resp:
            assert resp.status == 404
        async with session.post(f"{pipeline.url}/v1/streams/{request_id}/cancel",
                                headers={"Authorization": f"Bearer {key}"}) as resp:
            assert resp.status == 404


@pytest.mark.parametrize(("body", "param"), [
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0]"),
    ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]},
     "messages[0].content[0]"),
])
async def test_untranslatable_is_400_before_any_byte(pipeline: Pipeline, body: dict[str, Any],
                                                     param: str) -> None:
    for stream in (False, True):
        status, _, answer = await post(pipeline, {"model": "chat-only", "max_tokens": 5,
                                                   "messages": HELLO, "stream": stream,
                                                   **body}, {"x-api-key": DEV_KEY})
        assert status == 400
        anthropic_error(answer, "invalid_request_error")
        assert "cannot be translated" in answer["error"]["message"]


async def test_hostile_user_id_is_not_a_quota_scope(client: anthropic.AsyncAnthropic,
                                                    pipeline: Pipeline) -> None:
    raw = await client.messages.with_raw_response.create(
        model="sim", max_tokens=3, messages=HELLO, metadata={"user_id": "a.b.*.>"})
    assert (await raw.parse()).usage.output_tokens == 3
    [record] = await usage_of(pipeline.config, raw.headers["request-id"])
    assert record.user == ""


# -- WebSocket ----------------------------------------------------------------------------


async def test_websocket_path_v1_messages(pipeline: Pipeline) -> None:
    from websockets.asyncio.client import connect

    async with connect(f"ws://127.0.0.1:{pipeline.port}/v1/ws", max_size=None,
                       additional_headers={"Authorization": f"Bearer {DEV_KEY}"}) as ws:
        await ws.send(json.dumps({"type": "request", "id": "g1", "path": "/v1/messages",
                                  "body": {"model": "sim", "max_tokens": 5,
                                           "messages": HELLO}}))
        frames: list[dict[str, Any]] = []
        async with asyncio.timeout(30):
            while not frames or frames[-1]["type"] not in ("done", "error"):
                frames.append(json.loads(await ws.recv()))
    assert frames[-1]["type"] == "done"
    kinds = [f["data"]["type"] for f in frames if f["type"] == "chunk"]
    assert kinds == ["message_start", "ping", "content_block_start",
                     *["content_block_delta"] * 5, "content_block_stop", "message_delta",
                     "message_stop"]


# -- batches ------------------------------------------------------------------------------


async def test_batch_lines_with_url_v1_messages(pipeline: Pipeline) -> None:
    import io
    import time

    import openai

    lines = [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/messages",
              "body": {"model": "sim", "max_tokens": 4,
                       "messages": [{"role": "user", "content": f"item {i}"}]}}
             for i in range(3)]
    lines.append({"custom_id": "bad", "method": "POST", "url": "/v1/messages",
                  "body": {"model": "sim", "messages": HELLO}})  # no max_tokens
    data = b"".join(json.dumps(line).encode() + b"\n" for line in lines)
    async with openai.AsyncOpenAI(base_url=pipeline.base_url, api_key=DEV_KEY,
                                  max_retries=0) as oa:
        file = await oa.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch")
        batch = await oa.batches.create(input_file_id=file.id,
                                        endpoint="/v1/messages",  # type: ignore[arg-type]
                                        completion_window="24h")
        deadline = time.monotonic() + 60
        while batch.status not in ("completed", "failed", "expired"):
            assert time.monotonic() < deadline, batch
            await asyncio.sleep(0.2)
            batch = await oa.batches.retrieve(batch.id)
        assert batch.status == "failed", batch  # the line without max_tokens fails validation
        lines = lines[:3]
        data = b"".join(json.dumps(line).encode() + b"\n" for line in lines)
        file = await oa.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch")
        batch = await oa.batches.create(input_file_id=file.id,
                                        endpoint="/v1/messages",  # type: ignore[arg-type]
                                        completion_window="24h")
        deadline = time.monotonic() + 60
        while batch.status not in ("completed", "failed", "expired"):
            assert time.monotonic() < deadline, batch
            await asyncio.sleep(0.2)
            batch = await oa.batches.retrieve(batch.id)
        assert batch.status == "completed", batch
        assert batch.output_file_id is not None
        content = await oa.files.content(batch.output_file_id)
    out = [json.loads(line) for line in content.content.splitlines() if line.strip()]
    assert sorted(o["custom_id"] for o in out) == ["c0", "c1", "c2"]
    for o in out:
        body = o["response"]["body"]
        assert body["type"] == "message"
        assert body["usage"]["output_tokens"] == 4
        assert body["stop_reason"] == "max_tokens"


# -- Claude Code's traffic ------------------------------------------------------------------
# The shape of today's client (tests/messages_pipeline.claude_code_body); the
# real one runs in tests/test_claude_code.py where it is installed.


def _assemble(raw: bytes) -> tuple[list[dict[str, Any]], str, dict[str, Any]]:
    """The assistant's content blocks, stop reason and usage, from the event
    stream, the way Claude Code's client accumulates them."""
    blocks: dict[int, dict[str, Any]] = {}
    partial: dict[int, str] = {}
    stop, usage = "", {}
    for event in raw.split(b"\n\n"):
        data = [ln[6:] for ln in event.split(b"\n") if ln.startswith(b"data: ")]
        if not data:
            continue
        obj = json.loads(data[0])
        if obj["type"] == "message_start":
            usage = obj["message"]["usage"]
        elif obj["type"] == "content_block_start":
            blocks[obj["index"]] = obj["content_block"]
        elif obj["type"] == "content_block_delta":
            delta = obj["delta"]
            if delta["type"] == "text_delta":
                blocks[obj["index"]]["text"] += delta["text"]
            else:
                partial[obj["index"]] = partial.get(obj["index"], "") + delta["partial_json"]
        elif obj["type"] == "content_block_stop" and obj["index"] in partial:
            blocks[obj["index"]]["input"] = json.loads(partial[obj["index"]])
        elif obj["type"] == "message_delta":
            stop = obj["delta"]["stop_reason"]
            usage = {**usage, **obj["usage"]}
    return [blocks[i] for i in sorted(blocks)], stop, usage


_TOOLS = [{"name": "Bash", "description": "Run a command", "input_schema": {
    "type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}},
    {"name": "Read", "description": "Read a file", "input_schema": {
        "type": "object", "properties": {"path": {"type": "string"}}}}]


async def test_claude_code_tool_loop(pipeline: Pipeline, chat_only: FakeBackend) -> None:
    """Traffic as Claude Code sends it (its headers, ``?beta=true``, a system
    turn inside ``messages``, thinking, context_management, output_config,
    cache_control, tools, streaming): two user questions, each a tool loop
    (tool_use, tool_result, text), over translation. The system turn folds
    into the one system message a chat backend gets."""
    marker = uuid.uuid4().hex
    session = str(uuid.uuid4())
    turns: list[dict[str, Any]] = []
    headers = {**CLAUDE_CODE_HEADERS, "x-api-key": DEV_KEY}
    stops = []
    async with aiohttp.ClientSession() as session_http:
        for question in (f"list files {marker}", f"and now? {marker}"):
            turns.append({"role": "user", "content": [
                {"type": "text", "text": question, "cache_control": {"type": "ephemeral"}}]})
            for _ in range(2):
                async with session_http.post(
                        f"{pipeline.url}/v1/messages?beta=true", headers=headers,
                        json=claude_code_body("chat-only", turns, _TOOLS, session)) as resp:
                    assert resp.status == 200, await resp.text()
                    assert resp.headers["content-type"].startswith("text/event-stream")
                    content, stop, usage = _assemble(await resp.read())
                stops.append(stop)
                assert usage["output_tokens"] > 0
                turns.append({"role": "assistant", "content": content})
                if stop != "tool_use":
                    break
                call = content[-1]
                assert call["type"] == "tool_use"
                assert call["input"] == {"query": "aaabbbccc"}
                turns.append({"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": call["id"],
                     "content": [{"type": "text", "text": "README.md"}]}]})
    assert stops == ["tool_use", "end_turn", "tool_use", "end_turn"]
    sent = [r.body for r in chat_only.records if marker in json.dumps(r.body)]
    assert len(sent) == 4
    assert sent[-1]["messages"][0] == {
        "role": "system", "content": "x-anthropic-billing-header: cc_version=2.1.332.1c9; "
                                     "cc_entrypoint=sdk-cli;\nYou are Claude Code.\n\n"
                                     "# Environment\n - Primary working directory: /tmp/x"}
    assert [m["role"] for m in sent[-1]["messages"]] == [
        "system", "user", "assistant", "tool", "assistant", "user", "assistant", "tool"]
    assert sent[-1]["user"] == claude_code_body("", [{}], [], session)["metadata"]["user_id"]
    assert not {"thinking", "context_management", "output_config"} & set(sent[-1])
    assert "cache_control" not in json.dumps(sent[-1])


async def test_claude_code_passthrough_is_untouched(pipeline: Pipeline,
                                                    native: FakeBackend) -> None:
    """The same body on a Messages passthrough model reaches the backend as
    sent (``model`` aside), with Claude Code's beta list unchanged."""
    marker = uuid.uuid4().hex
    body = claude_code_body("native", [{"role": "user", "content": marker}], _TOOLS, marker)
    async with aiohttp.ClientSession() as session, session.post(
            f"{pipeline.url}/v1/messages?beta=true", json=body,
            headers={**CLAUDE_CODE_HEADERS, "x-api-key": DEV_KEY}) as resp:
        assert resp.status == 200, await resp.text()
        _, stop, _ = _assemble(await resp.read())
    assert stop == "end_turn"
    [record] = [r for r in native.records if marker in json.dumps(r.body)]
    assert record.body == {**body, "model": "fake-model"}
    assert record.headers["anthropic-beta"] == BETA


async def test_claude_code_count_tokens(pipeline: Pipeline) -> None:
    """count_tokens as Claude Code calls it for /context: ``?beta=true``, the
    token-counting beta, a bearer key, a body of model, messages and tools."""
    headers = {**CLAUDE_CODE_HEADERS, "Authorization": f"Bearer {DEV_KEY}",
               "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14,"
                                 "context-management-2025-06-27,token-counting-2024-11-01"}
    for tools in ([], _TOOLS[:1]):
        body = {"model": "sim", "messages": [{"role": "user", "content": "foo"}], "tools": tools}
        status, got, answer = await post(pipeline, body, headers,
                                         "/v1/messages/count_tokens?beta=true")
        assert status == 200, answer
        assert answer == {"input_tokens": estimate_prompt_tokens(Api.MESSAGES, body)}
        assert got["x-tidegate-token-count"] == "estimate"


def _raw(pipeline: Pipeline, headers: bytes, body: bytes) -> tuple[int, bytes]:
    """One request as raw bytes (headers aiohttp's client would refuse to send)."""
    import socket

    data = (b"POST /v1/messages HTTP/1.1\r\nHost: t\r\nConnection: close\r\n"
            b"Content-Type: application/json\r\n" + headers
            + b"Content-Length: %d\r\n\r\n" % len(body) + body)
    with socket.create_connection(("127.0.0.1", pipeline.port), timeout=30) as sock:
        sock.sendall(data)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    head, _, rest = b"".join(chunks).partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), rest


@pytest.mark.parametrize(("headers", "status"), [
    (b"x-api-key: \xff\xfe\r\n", 401),
    (b"x-api-key: \r\n", 401),
    (b"Authorization: Bearer wrong\r\nx-api-key: " + DEV_KEY.encode() + b"\r\n", 401),
    (b"x-api-key: " + DEV_KEY.encode() + b"\r\nanthropic-beta: " + b"b" * 7000 + b"\r\n", 200),
    (b"x-api-key: " + DEV_KEY.encode() + b"\r\nanthropic-version: \xc3\xa9\r\n", 400),
    (b"x-api-key: " + DEV_KEY.encode() + b"\r\nanthropic-beta: \xff\xfe\r\n", 400),
])
async def test_hostile_headers(pipeline: Pipeline, native: FakeBackend, headers: bytes,
                               status: int) -> None:
    """Keys and forwarded headers a client should not send: an Anthropic-shaped
    401 or 400 (a forwarded header that would not pass unchanged), or a
    normal answer; never a 500, and the edge serves on."""
    body = json.dumps({"model": "native", "max_tokens": 2, "messages": HELLO}).encode()
    got, reply = await asyncio.to_thread(_raw, pipeline, headers, body)
    assert got == status
    if status != 200:
        anthropic_error(json.loads(reply), {401: "authentication_error",
                                            400: "invalid_request_error"}[status])
    status_after, _, _ = await post(pipeline, {"model": "sim", "max_tokens": 2,
                                               "messages": HELLO}, {"x-api-key": DEV_KEY})
    assert status_after == 200
