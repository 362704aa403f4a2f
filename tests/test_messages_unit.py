"""Anthropic Messages API, sans-I/O: validation (hostile bodies), the
request translation, the chat-stream translator and the passthrough parser,
fed at every byte boundary."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tidegate.config import ModelConfig
from tidegate.errors import ApiError, BackendError
from tidegate.validation.messages import quota_user, validate_messages
from tidegate.wire import anthropic
from tidegate.wire.protocol import Api
from workers.backends.messages_sse import MessagesPassthrough, MessagesTranslator
from workers.backends.messages_translate import to_chat, to_message

MODELS = {"m": ModelConfig(name="m", max_output_tokens=4096)}
OK: dict[str, Any] = {"model": "m", "max_tokens": 10,
                      "messages": [{"role": "user", "content": "hi"}]}


def _with(**fields: Any) -> bytes:
    return json.dumps({**OK, **fields}).encode()


@pytest.mark.parametrize(("raw", "param"), [
    (b"[]", None),
    (b'"x"', None),
    (b"{" * 200 + b"}" * 200, None),
    (_with(max_tokens=None), "max_tokens"),
    (_with(max_tokens="10"), "max_tokens"),
    (_with(max_tokens=0), "max_tokens"),
    (_with(max_tokens=1 << 70), "max_tokens"),
    (_with(messages="hi"), "messages"),
    (_with(messages=[]), "messages"),
    (_with(messages=[1]), "messages[0]"),
    (_with(messages=[{"role": "tool", "content": "x"}]), "messages[0].role"),
    (_with(messages=[{"role": "system", "content": [{"type": "image"}]}]),
     "messages[0].content"),
    (_with(messages=[{"role": "system", "content": 3}]), "messages[0].content"),
    (_with(thinking={"type": 5}), "thinking"),
    (_with(thinking="adaptive"), "thinking"),
    (_with(thinking={"type": "enabled", "budget_tokens": "many"}), "thinking.budget_tokens"),
    (_with(thinking={"type": "adaptive", "display": 1}), "thinking.display"),
    (_with(context_management=[]), "context_management"),
    (_with(context_management={"edits": {}}), "context_management.edits"),
    (_with(context_management={"edits": [{"keep": "all"}]}), "context_management.edits[0]"),
    (_with(output_config="high"), "output_config"),
    (_with(output_config={"effort": 3}), "output_config.effort"),
    (_with(output_config={"format": "json"}), "output_config.format"),
    (_with(messages=[{"role": "user", "content": 5}]), "messages[0].content"),
    (_with(messages=[{"role": "user", "content": [{"text": "x"}]}]), "messages[0].content[0]"),
    (_with(messages=[{"role": "user", "content": [{"type": "text", "text": 1}]}]),
     "messages[0].content[0].text"),
    (_with(messages=[{"role": "assistant", "content": [
        {"type": "tool_use", "id": "a", "name": "f", "input": "x"}]}]),
     "messages[0].content[0].input"),
    (_with(messages=[{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "a", "content": 7}]}]),
     "messages[0].content[0].content"),
    (_with(messages=[{"role": "user", "content": [{"type": "image", "source": "x"}]}]),
     "messages[0].content[0].source"),
    (_with(system=5), "system"),
    (_with(system=[{"type": "image"}]), "system"),
    (_with(stop_sequences=[""]), "stop_sequences"),
    (_with(stop_sequences="x"), "stop_sequences"),
    (_with(stop_sequences=["x" * 1001]), "stop_sequences"),
    (_with(stop_sequences=["x"] * 17), "stop_sequences"),
    (_with(temperature=5), "temperature"),
    (_with(top_p="x"), "top_p"),
    (_with(top_k=-1), "top_k"),
    (_with(tools={}), "tools"),
    (_with(tools=[{"name": "f"}]), "tools[0].input_schema"),
    (_with(tools=[{"input_schema": {}}]), "tools[0]"),
    (_with(tool_choice="auto"), "tool_choice"),
    (_with(tool_choice={"type": "tool"}), "tool_choice.name"),
    (_with(service_tier=["auto"]), "service_tier"),
    (_with(service_tier=1), "service_tier"),
    (_with(metadata="x"), "metadata"),
    (_with(metadata={"user_id": 5}), "metadata.user_id"),
    (_with(stream="yes"), "stream"),
    (_with(model=5), "model"),
])
def test_hostile_bodies_are_400(raw: bytes, param: str | None) -> None:
    with pytest.raises(ApiError) as caught:
        validate_messages(raw, Api.MESSAGES, MODELS)
    assert caught.value.status == 400
    if param is not None:
        assert caught.value.param == param


# What Claude Code 2.1.332 sends (tests/test_claude_code.py runs the real one).
TODAY = {"model": "m", "max_tokens": 4096, "stream": True,
         "system": [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1"},
                    {"type": "text", "text": "You are Claude Code.",
                     "cache_control": {"type": "ephemeral"}}],
         "messages": [
             {"role": "user", "content": [
                 {"type": "text", "text": "<system-reminder>...</system-reminder>"},
                 {"type": "text", "text": "Say hello", "cache_control": {"type": "ephemeral"}}]},
             {"role": "system", "content": [{"type": "text", "text": "# Environment",
                                             "cache_control": {"type": "ephemeral"}}]},
             {"role": "assistant", "content": [
                 {"type": "thinking", "thinking": "", "signature": "c2ln"},
                 {"type": "text", "text": "Hello"}]},
             {"role": "user", "content": "again"}],
         "tools": [{"name": "Bash", "input_schema": {"type": "object"}},
                   {"name": "Later", "input_schema": {"type": "object"}, "defer_loading": True}],
         "metadata": {"user_id": '{"device_id":"d","account_uuid":"","session_id":"s"}'},
         "thinking": {"type": "adaptive", "display": "omitted"},
         "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
         "output_config": {"effort": "medium"},
         "cache_control": {"type": "ephemeral"}}


def test_todays_claude_code_body_validates_and_translates() -> None:
    """A ``system`` turn in ``messages`` folds into the one system message; the
    thinking block, ``thinking``, ``context_management`` (clearing thinking),
    ``output_config.effort`` and every ``cache_control`` stay away from a chat
    backend; the JSON text in ``metadata.user_id`` gives its device as the quota user."""
    valid = validate_messages(json.dumps(TODAY).encode(), Api.MESSAGES, MODELS)
    assert valid.body == TODAY
    for thinking in ({"type": "enabled", "budget_tokens": 2048}, {"type": "disabled"},
                     {"type": "a-later-kind"}):
        validate_messages(json.dumps({**TODAY, "thinking": thinking}).encode(), Api.MESSAGES,
                          MODELS)
    assert quota_user(TODAY) == "d"
    chat = to_chat(TODAY, "up", stream=True)
    assert chat["messages"] == [
        {"role": "system",
         "content": "x-anthropic-billing-header: cc_version=2.1\nYou are Claude Code."
                    "\n\n# Environment"},
        {"role": "user", "content": "<system-reminder>...</system-reminder>Say hello"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "again"}]
    assert [t["function"]["name"] for t in chat["tools"]] == ["Bash", "Later"]
    assert not {"thinking", "context_management", "output_config", "cache_control",
                "metadata", "response_format"} & set(chat)
    assert "cache_control" not in json.dumps(chat)


@pytest.mark.parametrize("tier", ["auto", "standard_only", "a-later-tier"])
def test_service_tier_is_kept_for_anthropic_and_dropped_in_translation(tier: str) -> None:
    body = {**TODAY, "service_tier": tier}
    assert validate_messages(json.dumps(body).encode(), Api.MESSAGES, MODELS).body == body
    assert "service_tier" not in to_chat(body, "up", stream=True)


def test_output_format_is_a_response_format() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "string"}}}
    expected = {"type": "json_schema",
                "json_schema": {"name": "output", "schema": schema, "strict": True}}
    for body in ({**OK, "output_config": {"effort": "low",
                                          "format": {"type": "json_schema", "schema": schema}}},
                 {**OK, "output_format": {"type": "json_schema", "schema": schema}}):
        assert to_chat(body, "up", stream=False)["response_format"] == expected
    strict = {**OK, "tools": [{"name": "f", "input_schema": schema, "strict": True}]}
    assert to_chat(strict, "up", stream=False)["tools"][0]["function"]["strict"] is True


@pytest.mark.parametrize(("fields", "param"), [
    ({"context_management": {"edits": [{"type": "clear_thinking_20251015"},
                                       {"type": "clear_tool_uses_20250919"}]}},
     "context_management.edits[1]"),
    ({"mcp_servers": [{"type": "url", "url": "https://mcp.example", "name": "x"}]},
     "mcp_servers"),
    ({"container": "container_1"}, "container"),
    ({"output_config": {"format": {"type": "xml"}}}, "output_config.format"),
    ({"output_format": {"type": "json_schema"}}, "output_format"),
])
def test_what_changes_the_answer_untranslated_is_400_naming_it(fields: dict[str, Any],
                                                                param: str) -> None:
    # the edge lets it by:
    validate_messages(json.dumps({**OK, **fields}).encode(), Api.MESSAGES, MODELS)
    with pytest.raises(BackendError) as caught:
        to_chat({**OK, **fields}, "up", stream=False)
    assert caught.value.status == 400
    assert caught.value.param == param
    assert "cannot be translated" in str(caught.value)


def test_unknown_model_is_404_and_count_tokens_needs_no_max_tokens() -> None:
    with pytest.raises(ApiError) as caught:
        validate_messages(_with(model="other"), Api.MESSAGES, MODELS)
    assert caught.value.status == 404
    body = json.dumps({"model": "m", "messages": OK["messages"], "stream": True}).encode()
    valid = validate_messages(body, Api.MESSAGES, MODELS, count_tokens=True)
    assert not valid.stream


@pytest.mark.parametrize(("user", "quota"), [
    ("user_ab12-x", "user_ab12-x"), ("a.b", ""), ("a b", ""), ("*", ""), (">", ""),
    ("", ""), ("x" * 129, ""), (None, ""), ("ü", ""),
    # Claude Code's JSON text: its account, else its device; never its session.
    ('{"device_id":"d1ab","account_uuid":"","session_id":"s-1"}', "d1ab"),
    ('{"device_id":"d1ab","account_uuid":"a-9","session_id":"s-1"}', "a-9"),
    ('{"device_id":"a.b","account_uuid":""}', ""), ('{"session_id":"s-1"}', ""),
    ('{"device_id":' + "[" * 5000, ""), ("{" + " " * 2000 + "}", ""), ("{x", ""),
])
def test_quota_user_is_a_safe_token_or_none(user: Any, quota: str) -> None:
    assert quota_user({"metadata": {"user_id": user}}) == quota


def test_errors_in_anthropic_shape() -> None:
    status, body = anthropic.error_body(503, "busy")
    assert status == 529
    assert json.loads(body) == {"type": "error", "error": {"type": "overloaded_error",
                                                           "message": "busy"}}
    assert anthropic.error_body(429, "x")[0] == 429
    assert json.loads(anthropic.error_body(502, "x")[1])["error"]["type"] == "api_error"
    assert anthropic.error_event(401, "no").startswith(b"event: error\ndata: ")


def test_to_chat_translates_every_block() -> None:
    body = {"model": "m", "max_tokens": 9, "system": [{"type": "text", "text": "be kind"}],
            "stop_sequences": ["END"], "temperature": 0.5, "top_k": 3,
            "metadata": {"user_id": "u1"}, "thinking": {"type": "enabled"},
            "vendor_extra": 1,
            "tools": [{"name": "f", "input_schema": {"type": "object"}}],
            "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
            "messages": [
                {"role": "user", "content": [
                    {"type": "text", "text": "look"},
                    {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                 "data": "AAAA"}}]},
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "hmm"},
                    {"type": "text", "text": "calling"},
                    {"type": "tool_use", "id": "t1", "name": "f", "input": {"a": 1}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "t1", "is_error": True,
                     "content": [{"type": "text", "text": "bad"}]},
                    {"type": "text", "text": "again"}]}]}
    chat = to_chat(body, "up", stream=True)
    assert chat["messages"] == [
        {"role": "system", "content": "be kind"},
        {"role": "user", "content": [
            {"type": "text", "text": "look"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]},
        {"role": "assistant", "content": "calling", "tool_calls": [
            {"id": "t1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]},
        {"role": "tool", "tool_call_id": "t1", "content": "Error: bad"},
        {"role": "user", "content": "again"}]
    assert chat["model"] == "up"
    assert chat["stop"] == ["END"]
    assert chat["tool_choice"] == "required"
    assert chat["parallel_tool_calls"] is False
    assert chat["user"] == "u1"
    assert chat["top_k"] == 3
    assert chat["vendor_extra"] == 1
    assert "thinking" not in chat
    assert chat["stream_options"] == {"include_usage": True}


@pytest.mark.parametrize("block", [
    {"type": "document", "source": {}},
    {"type": "search_result"},
])
def test_untranslatable_blocks_are_400(block: dict[str, Any]) -> None:
    body = {**OK, "messages": [{"role": "user", "content": [block]}]}
    with pytest.raises(BackendError) as caught:
        to_chat(body, "up", stream=False)
    assert caught.value.status == 400


def test_server_tools_are_400_in_translation() -> None:
    body = {**OK, "tools": [{"type": "web_search_20250305", "name": "web_search"}]}
    with pytest.raises(BackendError) as caught:
        to_chat(body, "up", stream=False)
    assert caught.value.param == "tools[0]"


def _chunk(delta: dict[str, Any] | None = None, finish: str | None = None,
           usage: dict[str, int] | None = None, **choice: Any) -> bytes:
    obj: dict[str, Any] = {"id": "c", "choices": [] if delta is None else [
        {"index": 0, "delta": delta, "finish_reason": finish, **choice}]}
    if usage is not None:
        obj["usage"] = usage
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


CHAT_STREAM = b"".join([
    b": keepalive\n\n",
    _chunk({"role": "assistant", "content": ""}),
    _chunk({"content": "Hel"}),
    _chunk({"content": "lo"}),
    _chunk({"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                            "function": {"name": "f", "arguments": ""}}]}),
    _chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"a"'}}]}),
    _chunk({"tool_calls": [{"index": 0, "function": {"arguments": ':1}'}}]}),
    _chunk({}, "tool_calls"),
    _chunk(usage={"prompt_tokens": 7, "completion_tokens": 4, "total_tokens": 11}),
    b"data: [DONE]\n\n",
])


def _events(out: bytes) -> list[tuple[str, dict[str, Any]]]:
    found = []
    for raw in out.split(b"\n\n"):
        if raw:
            name, data = raw.split(b"\n")
            found.append((name.removeprefix(b"event: ").decode(),
                          json.loads(data.removeprefix(b"data: "))))
    return found


def test_translator_writes_anthropic_events_at_any_split() -> None:
    whole = MessagesTranslator(prompt_tokens=3, model="m", message_id="msg_1",
                               client_model="alias")
    out = whole.feed(CHAT_STREAM)
    assert whole.done
    events = _events(out)
    assert [name for name, _ in events] == [
        "message_start", "ping", "content_block_start", "content_block_delta",
        "content_block_delta", "content_block_stop", "content_block_start",
        "content_block_delta", "content_block_delta", "content_block_stop", "message_delta",
        "message_stop"]
    assert all(data["type"] == name for name, data in events)
    assert events[0][1]["message"]["model"] == "alias"
    assert events[0][1]["message"]["id"] == "msg_1"
    assert events[6][1]["content_block"] == {"type": "tool_use", "id": "call_1", "name": "f",
                                             "input": {}}
    assert events[7][1] == {"type": "content_block_delta", "index": 1,
                            "delta": {"type": "input_json_delta", "partial_json": '{"a"'}}
    assert events[10][1] == {"type": "message_delta",
                             "delta": {"stop_reason": "tool_use", "stop_sequence": None},
                             "usage": {"input_tokens": 7, "output_tokens": 4}}
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (7, 4)  # once
    for cut in range(1, len(CHAT_STREAM)):
        split = MessagesTranslator(prompt_tokens=3, model="m", message_id="msg_1",
                                   client_model="alias")
        got = split.feed(CHAT_STREAM[:cut]) + split.feed(CHAT_STREAM[cut:]) + split.flush()
        assert got == out, cut


def test_translator_error_chunk_raises_and_no_done_still_closes() -> None:
    t = MessagesTranslator(prompt_tokens=1, model="m", message_id="x", client_model="m")
    with pytest.raises(BackendError):
        t.feed(b'data: {"error": {"message": "boom"}}\n\n')
    t = MessagesTranslator(prompt_tokens=1, model="m", message_id="x", client_model="m")
    t.feed(_chunk({"content": "a"}) + _chunk({}, "stop", stop_reason="END"))
    events = _events(t.flush())
    assert events[-2][1]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "END"}
    assert t.done


def test_to_message_from_a_chat_body() -> None:
    body = {"choices": [{"index": 0, "finish_reason": "length", "message": {
        "role": "assistant", "content": "hi", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "nope"}}]}}],
        "usage": {"prompt_tokens": 5, "completion_tokens": 2}}
    message = to_message(body, "msg_x", "alias")
    assert message["content"] == [{"type": "text", "text": "hi"}, {
        "type": "tool_use", "id": "c1", "name": "f", "input": {"_raw_arguments": "nope"}}]
    assert message["stop_reason"] == "max_tokens"
    assert message["usage"] == {"input_tokens": 5, "output_tokens": 2}


NATIVE = (b'event: message_start\ndata: {"type":"message_start","message":{"id":"msg_1",'
          b'"usage":{"input_tokens":10,"cache_read_input_tokens":5,"output_tokens":1}}}\n\n'
          b": comment\n\n"
          b'event: content_block_start\ndata: {"type":"content_block_start","index":0,'
          b'"content_block":{"type":"text","text":""}}\n\n'
          b'event: ping\ndata: {"type": "ping"}\n\n'
          b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,'
          b'"delta":{"type":"text_delta","text":"\\"type\\":\\"message_stop\\""}}\n\n'
          b'event: content_block_stop\ndata: {"type":"content_block_stop","index":0}\n\n'
          b'event: message_delta\ndata: {"type":"message_delta","delta":{"stop_reason":'
          b'"end_turn","stop_sequence":null},"usage":{"output_tokens":9}}\n\n'
          b'event: message_stop\ndata: {"type":"message_stop"}\n\n'
          b"event: late\ndata: {}\n\n")


def test_passthrough_relays_bytes_and_counts_usage_once_at_any_split() -> None:
    expected = NATIVE.replace(b": comment\n\n", b"").replace(b"event: late\ndata: {}\n\n", b"")
    for cut in range(1, len(NATIVE)):
        p = MessagesPassthrough(prompt_tokens=1, model="m")
        got = p.feed(NATIVE[:cut]) + p.feed(NATIVE[cut:]) + p.flush()
        assert got == expected, cut
        assert p.done
        assert (p.usage.prompt_tokens, p.usage.completion_tokens) == (15, 9)
        assert p.finish_reason == "stop"


def test_passthrough_error_event_raises() -> None:
    p = MessagesPassthrough(prompt_tokens=1, model="m")
    with pytest.raises(BackendError):
        p.feed(b'event: error\ndata: {"type":"error","error":{"type":"overloaded_error",'
               b'"message":"Overloaded"}}\n\n')


def test_edge_writes_tidegate_503s_as_529_overloaded() -> None:
    """Queue mode's refusals, no worker, a full queue, a draining edge: every
    503 of tidegate reaches a Messages client as 529 overloaded_error with
    retry-after, before the stream and inside it; other routes keep 503."""
    from edge.errors import error_response, sse_error_event
    from tidegate.errors import unavailable
    from tidegate.wire.protocol import Api

    error = unavailable("The model is in queue mode and its queue is full.", code="queue_full",
                        retry_after=5)
    response = error_response(error, Api.MESSAGES)
    assert response.status == 529
    assert response.headers["Retry-After"] == "5"
    assert response.body is not None
    assert json.loads(bytes(response.body)) == {"type": "error", "error": {
        "type": "overloaded_error", "message": error.message}}
    assert error_response(error).status == 503
    event = sse_error_event(error, Api.MESSAGES)
    assert event.startswith(b"event: error\ndata: ")
    assert json.loads(event.split(b"data: ", 1)[1])["error"]["type"] == "overloaded_error"
    assert sse_error_event(error).startswith(b"data: {\"error\"")


def test_a_stream_without_message_start_gets_one_spliced_in() -> None:
    """llama-server's /v1/messages (build 11434) opens with content_block_start:
    the passthrough writes the message_start the SDK needs in front, once;
    a stream that has its own passes unchanged."""
    bare = (b'event: content_block_start\ndata: {"type":"content_block_start","index":0,'
            b'"content_block":{"type":"text","text":""}}\n\n'
            b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,'
            b'"delta":{"type":"text_delta","text":"hi"}}\n\n')
    p = MessagesPassthrough(prompt_tokens=3, model="m", message_id="msg_x", client_model="c")
    out = p.feed(bare)
    head, rest = out.split(b"\n\n", 1)
    assert head.startswith(b"event: message_start\ndata: ")
    start = json.loads(head.split(b"data: ", 1)[1])
    assert start["message"]["id"] == "msg_x"
    assert start["message"]["model"] == "c"
    assert start["message"]["usage"]["input_tokens"] == 3
    assert rest == bare
    assert p.feed(bare).count(b"message_start") == 0  # once, at the start
    whole = (b'event: message_start\ndata: {"type":"message_start","message":{"id":"m1",'
             b'"type":"message","role":"assistant","content":[],"model":"b",'
             b'"usage":{"input_tokens":2,"output_tokens":0}}}\n\n') + bare
    q = MessagesPassthrough(prompt_tokens=3, model="m", message_id="msg_x", client_model="c")
    assert q.feed(whole) == whole
