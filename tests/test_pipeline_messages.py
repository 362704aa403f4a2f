"""Anthropic's Messages API through the pipeline with the official ``anthropic``
SDK: translation (create, stream, tools, stop sequences), errors, auth and
quotas, passthrough, cancel (tests/messages_pipeline.py has the set-up)."""
# ruff: noqa: F811

from __future__ import annotations

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
    FAKE_TOKENS,
    HELLO,
    SIM,
    WEATHER,
    anthropic_error,
    chat_only,
    client,
    native,
    pipeline,
    post,
    simulated,
)
from tests.pipeline import DEV_KEY, Pipeline, usage_of
from tests.poll import eventually

pytestmark = pytest.mark.pipeline


# -- translation: create and stream ------------------------------------------------------


async def test_create_against_simulator(client: anthropic.AsyncAnthropic,
                                        pipeline: Pipeline) -> None:
    raw = await client.messages.with_raw_response.create(
        model="tidegate-sim", max_tokens=1000, system="Be brief", messages=HELLO,
        metadata={"user_id": "user_abc-1"})
    message = await raw.parse()
    assert message.type == "message"
    assert message.role == "assistant"
    assert message.model == "tidegate-sim"
    assert message.stop_reason == "end_turn"
    body, usage = await simulated({"model": "tidegate-sim", "max_tokens": 1000,
                                   "system": "Be brief", "messages": HELLO,
                                   "metadata": {"user_id": "user_abc-1"}}, False)
    expected = json.loads(body)
    assert [b.model_dump(exclude_none=True) for b in message.content] == expected["content"]
    assert (message.usage.input_tokens, message.usage.output_tokens) == (
        usage.prompt_tokens, usage.completion_tokens) == (
        expected["usage"]["input_tokens"], SIM.length)
    request_id = raw.headers["request-id"]
    assert message.id == "msg_" + request_id
    [record] = await usage_of(pipeline.config, request_id)
    assert (record.prompt_tokens, record.completion_tokens) == (
        usage.prompt_tokens, usage.completion_tokens)
    assert record.user == "user_abc-1"  # metadata.user_id is the quota's user


async def test_stream_against_simulator(client: anthropic.AsyncAnthropic,
                                        pipeline: Pipeline) -> None:
    async with client.messages.stream(model="sim", max_tokens=1000, messages=HELLO) as stream:
        kinds = [event.type async for event in stream]
        final = await stream.get_final_message()
    assert kinds[0] == "message_start"
    assert kinds[-1] == "message_stop"
    assert "content_block_start" in kinds
    assert "content_block_stop" in kinds
    assert kinds[-2] == "message_delta"
    _, usage = await simulated({"model": "sim", "max_tokens": 1000, "messages": HELLO}, True)
    assert (final.usage.input_tokens, final.usage.output_tokens) == (
        usage.prompt_tokens, usage.completion_tokens)
    assert final.usage.output_tokens == SIM.length
    assert final.stop_reason == "end_turn"
    assert final.content[0].type == "text"
    assert final.content[0].text
    [record] = await usage_of(pipeline.config, final.id.removeprefix("msg_"))
    assert (record.prompt_tokens, record.completion_tokens) == (
        usage.prompt_tokens, usage.completion_tokens)  # counted once


async def test_raw_stream_events_in_anthropic_order(pipeline: Pipeline) -> None:
    """The wire itself: every event has its event: line, no [DONE], a ping."""
    async with aiohttp.ClientSession() as session, session.post(
            f"{pipeline.url}/v1/messages", headers={"x-api-key": DEV_KEY,
                                                    "anthropic-version": "2023-06-01"},
            json={"model": "sim", "max_tokens": 5, "messages": HELLO,
                  "stream": True}) as resp:
        assert resp.status == 200
        raw = await resp.read()
    assert b"[DONE]" not in raw
    events = [e for e in raw.split(b"\n\n") if e and not e.startswith(b":")]
    names = [e.split(b"\n")[0] for e in events]
    assert names == [b"event: message_start", b"event: ping", b"event: content_block_start",
                     *[b"event: content_block_delta"] * 5, b"event: content_block_stop",
                     b"event: message_delta", b"event: message_stop"]
    delta = json.loads(events[-2].split(b"data: ", 1)[1])
    assert delta["delta"]["stop_reason"] == "max_tokens"
    assert delta["usage"]["output_tokens"] == 5


async def test_stream_translated_from_chat_backend(client: anthropic.AsyncAnthropic,
                                                  chat_only: FakeBackend,
                                                  pipeline: Pipeline) -> None:
    """``auto`` on a chat-only backend: /v1/messages answers 404, the worker
    translates from then on, and the usage is what the backend counted."""
    marker = uuid.uuid4().hex
    async with client.messages.stream(model="chat-only", max_tokens=1000, messages=[
            {"role": "user", "content": f"hello {marker}"}]) as stream:
        text = await stream.get_final_text()
        final = await stream.get_final_message()
    assert len(text) == FAKE_TOKENS * 4
    records = [r for r in chat_only.records if marker in json.dumps(r.body)]
    assert [r.path for r in records] == ["/v1/chat/completions"]
    assert records[0].body["stream_options"] == {"include_usage": True}
    assert final.usage.output_tokens == FAKE_TOKENS
    assert final.usage.input_tokens == (len(f"hello {marker}") + 3) // 4
    [record] = await usage_of(pipeline.config, final.id.removeprefix("msg_"))
    assert (record.prompt_tokens, record.completion_tokens) == (
        final.usage.input_tokens, FAKE_TOKENS)



async def test_auth_as_anthropic_clients_send_it(pipeline: Pipeline) -> None:
    async with anthropic.AsyncAnthropic(base_url=pipeline.url, api_key="sk-wrong",
                                        max_retries=0) as bad:
        with pytest.raises(anthropic.AuthenticationError) as caught:
            await bad.messages.create(model="sim", max_tokens=5, messages=HELLO)
    anthropic_error(caught.value.body, "authentication_error")
    # ANTHROPIC_AUTH_TOKEN: the key as a bearer token.
    async with anthropic.AsyncAnthropic(base_url=pipeline.url, auth_token=DEV_KEY,
                                        max_retries=0) as bearer:
        message = await bearer.messages.create(model="sim", max_tokens=5, messages=HELLO)
    assert message.usage.output_tokens == 5
    status, _, body = await post(pipeline, {"model": "sim", "max_tokens": 5,
                                             "messages": HELLO}, {})
    assert status == 401
    anthropic_error(body, "authentication_error")


@pytest.mark.parametrize(("body", "status", "kind"), [
    ({"model": "sim", "messages": HELLO}, 400, "invalid_request_error"),  # no max_tokens
    ({"model": "nope", "max_tokens": 5, "messages": HELLO}, 404, "not_found_error"),
    ({"model": "sim", "max_tokens": 5, "messages": []}, 400, "invalid_request_error"),
    ({"model": "sim", "max_tokens": 10**9, "messages": HELLO}, 400, "invalid_request_error"),
    (b"{not json", 400, "invalid_request_error"),
])
async def test_errors_in_anthropic_shape(pipeline: Pipeline, body: Any, status: int,
                                         kind: str) -> None:
    got, _, answer = await post(pipeline, body, {"x-api-key": DEV_KEY})
    assert got == status
    anthropic_error(answer, kind)


async def test_overloaded_backend_is_529(client: anthropic.AsyncAnthropic) -> None:
    """A backend's 529 (Anthropic's "overloaded") reaches the client as 529
    overloaded_error, with retry-after, which the SDK knows to retry."""
    with pytest.raises(anthropic.APIStatusError) as caught:
        await client.messages.create(model="native", max_tokens=5, messages=HELLO,
                                     extra_body={"fake_status": 529})
    assert caught.value.status_code == 529
    anthropic_error(caught.value.body, "overloaded_error")
    assert caught.value.response.headers["retry-after"] == "1"


async def test_quota_user_from_metadata(pipeline: Pipeline, module_nats_url: str) -> None:
    """metadata.user_id is the quota's user: a per-user limit stops that user
    (429 rate_limit_error, retry-after, anthropic-ratelimit-* headers) and no
    other."""
    import nats

    from tidegate.control.keys import create_key, ensure_keys_bucket
    from tidegate.control.policies import Policy, ensure_policies_bucket, set_policy

    tenant = "t" + uuid.uuid4().hex[:8]
    nc = await nats.connect(module_nats_url)
    try:
        js = nc.jetstream()
        key, _ = await create_key(await ensure_keys_bucket(js, pipeline.config), tenant)
        await set_policy(await ensure_policies_bucket(js, pipeline.config),
                         Policy(tenant=tenant, user="alice", rpm=3))
    finally:
        await nc.close()

    def body(user: str) -> dict[str, Any]:
        return {"model": "sim", "max_tokens": 3, "messages": HELLO,
                "metadata": {"user_id": user}}

    async def limited() -> bool:  # the edge knows the key, the dispatcher the policy
        status, headers, _ = await post(pipeline, body("alice"), {"x-api-key": key})
        return status == 200 and headers.get("anthropic-ratelimit-requests-limit") == "3"

    await eventually(limited, 30, "the key and alice's policy in force")
    statuses = []
    for _ in range(4):
        status, headers, answer = await post(pipeline, body("alice"), {"x-api-key": key})
        statuses.append(status)
    assert statuses[-1] == 429
    anthropic_error(answer, "rate_limit_error")
    assert int(headers["retry-after"]) >= 1
    assert headers["anthropic-ratelimit-requests-remaining"] == "0"
    status, _, _ = await post(pipeline, body("bob"), {"x-api-key": key})
    assert status == 200


# -- tools and stop sequences --------------------------------------------------------------


async def test_stream_tool_call_with_input_json_delta(client: anthropic.AsyncAnthropic,
                                                      chat_only: FakeBackend) -> None:
    marker = uuid.uuid4().hex
    async with client.messages.stream(
            model="chat-only", max_tokens=200, tools=[WEATHER],
            tool_choice={"type": "tool", "name": "get_weather"},
            messages=[{"role": "user", "content": f"weather? {marker}"}]) as stream:
        events = [event async for event in stream]
        final = await stream.get_final_message()
    partial = [e.delta.partial_json for e in events if e.type == "content_block_delta"
               and e.delta.type == "input_json_delta"]
    assert "".join(partial) == ARGUMENTS
    assert len(partial) == -(-len(ARGUMENTS) // 4)  # streamed in pieces, as the backend did
    [block] = final.content
    assert block.type == "tool_use"
    assert (block.name, block.input) == ("get_weather", {"query": "aaabbbccc"})
    assert final.stop_reason == "tool_use"
    assert final.usage.output_tokens == len(partial)  # what the backend counted
    [record] = [r for r in chat_only.records if marker in json.dumps(r.body)]
    assert record.body["tools"] == [{"type": "function", "function": {
        "name": "get_weather", "parameters": WEATHER["input_schema"],
        "description": WEATHER["description"]}}]
    assert record.body["tool_choice"] == {"type": "function",
                                          "function": {"name": "get_weather"}}


async def test_tool_loop_create(client: anthropic.AsyncAnthropic,
                                chat_only: FakeBackend) -> None:
    """A tool loop of several turns, not streamed: tool_use, then the
    tool_result goes back as a chat ``tool`` message and text comes out."""
    marker = uuid.uuid4().hex
    turns: list[dict[str, Any]] = [{"role": "user", "content": f"weather? {marker}"}]
    first = await client.messages.create(model="chat-only", max_tokens=200, tools=[WEATHER],
                                         messages=turns)  # type: ignore[arg-type]
    assert first.stop_reason == "tool_use"
    [call] = first.content
    assert call.type == "tool_use"
    turns += [{"role": "assistant", "content": [c.model_dump(exclude_none=True)
                                                for c in first.content]},
              {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                            "content": "sunny"}]}]
    second = await client.messages.create(model="chat-only", max_tokens=200, tools=[WEATHER],
                                          messages=turns)  # type: ignore[arg-type]
    assert second.stop_reason == "end_turn"
    assert second.content[0].type == "text"
    sent = [r for r in chat_only.records if marker in json.dumps(r.body)][-1].body["messages"]
    [sent_call] = sent[1].pop("tool_calls")
    assert sent[1] == {"role": "assistant", "content": None}
    assert json.loads(sent_call.pop("function").pop("arguments")) == {"query": "aaabbbccc"}
    assert sent_call == {"id": call.id, "type": "function"}
    assert sent[2] == {"role": "tool", "tool_call_id": call.id, "content": "sunny"}


@pytest.mark.parametrize("stream", [False, True])
async def test_stop_sequences(client: anthropic.AsyncAnthropic, stream: bool) -> None:
    body = {"model": "sim", "max_tokens": 1000, "messages": HELLO}
    raw, _ = await simulated(body, False)
    text = json.loads(raw)["content"][0]["text"]
    stop = " " + text.split(" ")[6]
    expected = text[:text.find(stop)]
    if stream:
        async with client.messages.stream(**body, stop_sequences=[stop]) as s:  # type: ignore[arg-type]
            final = await s.get_final_message()
    else:
        final = await client.messages.create(**body, stop_sequences=[stop])  # type: ignore[arg-type]
    assert final.stop_reason == "stop_sequence"
    assert final.stop_sequence == stop
    assert final.content[0].type == "text"
    assert final.content[0].text == expected


# -- passthrough -----------------------------------------------------------------------------


async def test_passthrough_stream_is_byte_for_byte(pipeline: Pipeline,
                                                   native: FakeBackend) -> None:
    marker = uuid.uuid4().hex
    headers = {"x-api-key": DEV_KEY, "anthropic-version": "2023-06-01", "anthropic-beta": BETA}
    async with aiohttp.ClientSession() as session, session.post(
            f"{pipeline.url}/v1/messages", headers=headers,
            json={"model": "native", "max_tokens": 100, "stream": True,
                  "messages": [{"role": "user", "content": f"hi {marker}"}]}) as resp:
        assert resp.status == 200
        raw = await resp.read()
    [record] = [r for r in native.records if marker in json.dumps(r.body)]
    assert record.path == "/v1/messages"
    assert record.headers["anthropic-beta"] == BETA  # unchanged
    assert record.headers["anthropic-version"] == "2023-06-01"
    assert record.body["model"] == "fake-model"
    kept = b"".join(e + b"\n\n" for e in raw.split(b"\n\n") if e and not e.startswith(b":"))
    assert kept == bytes(record.output)


async def test_passthrough_with_the_sdk(client: anthropic.AsyncAnthropic, pipeline: Pipeline,
                                        native: FakeBackend) -> None:
    marker = uuid.uuid4().hex
    prompt = f"hello there {marker}"
    async with client.messages.stream(
            model="native", max_tokens=100, messages=[{"role": "user", "content": prompt}],
            extra_headers={"anthropic-beta": BETA}) as stream:
        text = await stream.get_final_text()
        final = await stream.get_final_message()
    assert len(text) == FAKE_TOKENS * 4
    assert final.id.startswith("msg_fake")  # the backend's own message, relayed
    assert (final.usage.input_tokens, final.usage.output_tokens) == (
        (len(prompt) + 3) // 4, FAKE_TOKENS)
    created = await client.messages.with_raw_response.create(
        model="native", max_tokens=3, messages=[{"role": "user", "content": prompt}])
    message = await created.parse()
    assert message.stop_reason == "max_tokens"
    assert message.usage.output_tokens == 3
    [record] = await usage_of(pipeline.config, created.headers["request-id"])
    assert (record.prompt_tokens, record.completion_tokens) == ((len(prompt) + 3) // 4, 3)
    [sent] = [r for r in native.records if r.body.get("max_tokens") == 3
              and marker in json.dumps(r.body)]
    assert bytes(sent.output) == await created.read()


async def test_translate_mode_on_a_native_backend(client: anthropic.AsyncAnthropic,
                                                  native: FakeBackend) -> None:
    marker = uuid.uuid4().hex
    message = await client.messages.create(model="native-translated", max_tokens=100,
                                           messages=[{"role": "user", "content": marker}],
                                           extra_headers={"anthropic-beta": BETA})
    assert message.id.startswith("msg_")
    assert not message.id.startswith("msg_fake")
    [record] = [r for r in native.records if marker in json.dumps(r.body)]
    assert record.path == "/v1/chat/completions"
    assert "anthropic-beta" not in record.headers  # a chat backend does not get them


@pytest.mark.parametrize("model", ["native", "chat-only"])
async def test_disconnect_closes_the_backend_call(client: anthropic.AsyncAnthropic,
                                                  native: FakeBackend, chat_only: FakeBackend,
                                                  model: str) -> None:
    """Both modes: a client that leaves mid-stream closes the backend's
    connection (unknown fields such as fake_itl pass translation too)."""
    marker = uuid.uuid4().hex
    async with client.messages.stream(
            model=model, max_tokens=100, messages=[{"role": "user", "content": marker}],
            extra_body={"fake_itl": 0.5}) as stream:
        async for event in stream:
            if event.type == "content_block_delta":
                break
    backend = native if model == "native" else chat_only
    [record] = [r for r in backend.records if marker in json.dumps(r.body)]
    await eventually(lambda: record.closed_at is not None, 30,
                     "the backend's connection closed")
    assert not record.completed




async def test_backend_failure_mid_stream_is_an_error_event(
        client: anthropic.AsyncAnthropic) -> None:
    """A stream that breaks after it began ends with Anthropic's ``event:
    error`` (no [DONE], no message_stop), which the SDK raises."""
    seen: list[str] = []

    async def read() -> None:
        async with client.messages.stream(model="native", max_tokens=100, messages=HELLO,
                                          extra_body={"fake_fail_after": 5}) as stream:
            async for event in stream:
                seen.append(event.type)

    with pytest.raises(anthropic.APIStatusError) as caught:
        await read()
    assert "message_start" in seen
    assert "message_stop" not in seen
    anthropic_error(caught.value.body, "api_error")

