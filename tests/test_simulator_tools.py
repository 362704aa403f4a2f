"""The simulator's test-only tool call (``simulator.tool_call``,
workers/backends/simulator_tools.py): chat chunks the openai SDK parses, a
Messages answer the anthropic SDK's types take, the text again once the
tool's result is the last turn, and the config check of its arguments."""

from __future__ import annotations

import json
from typing import Any

import anthropic.types
import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from tests.test_simulator import events, make_request, read_all
from tidegate.config import ModelConfig, SimulatorConfig, load
from tidegate.errors import ConfigError
from tidegate.wire.protocol import Api
from workers.backends.simulator import SimulatorBackend

ARGUMENTS = '{"command": "echo tide", "description": "Print a word"}'
SIM = SimulatorConfig(ttft=0.0, tokens_per_second=10_000.0, length=8, tool_call="Bash",
                      tool_arguments=ARGUMENTS)
CHAT_TOOLS = [{"type": "function", "function": {"name": "Read", "parameters": {}}},
              {"type": "function", "function": {"name": "Bash", "parameters": {}}}]
MESSAGES_TOOLS = [{"name": "Bash", "input_schema": {"type": "object"}}]


def backend(sim: SimulatorConfig = SIM) -> SimulatorBackend:
    return SimulatorBackend(ModelConfig(name="sim", simulator=sim))


async def _read(body: dict[str, Any], api: Api = Api.CHAT, stream: bool = True) -> bytes:
    request = make_request(api, stream=stream, include_usage=stream and api == Api.CHAT,
                           **body)
    return b"".join(await read_all(await backend().open(request)))  # type: ignore[arg-type]


async def test_chat_answers_with_a_call_of_the_listed_tool() -> None:
    evs = events(await _read({"tools": CHAT_TOOLS}))
    for e in evs:
        ChatCompletionChunk.model_validate(e)
    calls = [c for e in evs if e["choices"] for c in e["choices"][0]["delta"].get("tool_calls", ())]
    assert calls[0]["id"] == "call_r1"
    assert calls[0]["function"]["name"] == "Bash"
    assert len(calls) > 2  # the arguments come in pieces
    assert "".join(c["function"]["arguments"] for c in calls) == ARGUMENTS
    assert [e["choices"][0]["finish_reason"] for e in evs if e["choices"]][-1] == "tool_calls"
    assert evs[-1]["usage"]["completion_tokens"] == len(calls) - 1
    body = ChatCompletion.model_validate(json.loads(await _read({"tools": CHAT_TOOLS},
                                                                stream=False)))
    assert body.choices[0].finish_reason == "tool_calls"
    [call] = body.choices[0].message.tool_calls or []
    assert call.function.arguments == ARGUMENTS  # type: ignore[union-attr]


@pytest.mark.parametrize("body", [
    {},  # no tools
    {"tools": CHAT_TOOLS[:1]},  # not the named one
    {"tools": CHAT_TOOLS, "messages": [  # the tool's result is in: text again
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "Bash", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c", "content": "tide"}]},
])
async def test_text_otherwise(body: dict[str, Any]) -> None:
    evs = events(await _read(body))
    assert [e["choices"][0]["finish_reason"] for e in evs if e["choices"]][-1] == "stop"
    assert not any("tool_calls" in e["choices"][0]["delta"] for e in evs if e["choices"])


async def test_messages_answers_with_tool_use_then_text() -> None:
    turns: list[dict[str, Any]] = [{"role": "user", "content": "go"}]
    raw = await _read({"messages": turns, "tools": MESSAGES_TOOLS, "max_tokens": 100},
                      Api.MESSAGES, stream=False)
    message = anthropic.types.Message.model_validate_json(raw)
    assert message.stop_reason == "tool_use"
    [use] = message.content
    assert use.type == "tool_use"
    assert use.name == "Bash"
    assert use.input == json.loads(ARGUMENTS)
    streamed = await _read({"messages": turns, "tools": MESSAGES_TOOLS, "max_tokens": 100},
                           Api.MESSAGES)
    assert b'"stop_reason":"tool_use"' in streamed
    assert b"input_json_delta" in streamed
    turns += [{"role": "assistant", "content": [message.content[0].model_dump()]},
              {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                            "content": "tide"}]}]
    again = anthropic.types.Message.model_validate_json(await _read(
        {"messages": turns, "tools": MESSAGES_TOOLS, "max_tokens": 100}, Api.MESSAGES,
        stream=False))
    assert again.stop_reason == "end_turn"
    assert again.content[0].type == "text"


@pytest.mark.parametrize("arguments", ["[]", "{", '"x"'])
def test_tool_arguments_must_be_a_json_object(arguments: str) -> None:
    model = {"name": "s", "simulator": {"tool_call": "Bash", "tool_arguments": arguments}}
    with pytest.raises(ConfigError, match="tool_arguments"):
        load(env={}, overrides={"models": [model]})


RESPONSES_TOOLS = [{"type": "function", "name": "Read", "parameters": {}},
                   {"type": "function", "name": "Bash", "parameters": {}}]


def _responses_events(data: bytes) -> list[Any]:
    """Each ``event:`` + ``data:`` pair, parsed by the openai SDK's own types."""
    from openai.types.responses import ResponseStreamEvent
    from pydantic import TypeAdapter
    adapter: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)
    out = []
    for raw in data.split(b"\n\n")[:-1]:
        kind, payload = raw.split(b"\n")
        event = adapter.validate_json(payload.removeprefix(b"data: "))
        assert kind == b"event: " + event.type.encode()
        out.append(event)
    return out


async def test_responses_answers_with_a_function_call() -> None:
    from openai.types.responses import Response
    evs = _responses_events(await _read({"input": "go", "tools": RESPONSES_TOOLS},
                                        Api.RESPONSES))
    assert [e.sequence_number for e in evs] == list(range(len(evs)))
    deltas = [e.delta for e in evs if e.type == "response.function_call_arguments.delta"]
    assert len(deltas) > 2  # the arguments come in pieces
    assert "".join(deltas) == ARGUMENTS
    assert [e.type for e in evs if "delta" not in e.type] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed"]
    final = evs[-1].response
    [call] = final.output
    assert (call.type, call.name, call.arguments, call.call_id) == (
        "function_call", "Bash", ARGUMENTS, "call_r1")
    assert final.usage.output_tokens == len(deltas)
    body = Response.model_validate_json(await _read({"input": "go", "tools": RESPONSES_TOOLS},
                                                    Api.RESPONSES, stream=False))
    assert body.status == "completed"
    assert body.output[0].model_dump() == call.model_dump()


@pytest.mark.parametrize("body", [
    {"input": "go"},  # no tools
    {"input": "go", "tools": RESPONSES_TOOLS[:1]},  # not the named one
    {"tools": RESPONSES_TOOLS, "input": [  # the function's output is in: text again
        {"role": "user", "content": "go"},
        {"type": "function_call", "call_id": "c", "name": "Bash", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c", "output": "tide"}]},
])
async def test_responses_text_otherwise(body: dict[str, Any]) -> None:
    evs = _responses_events(await _read(body, Api.RESPONSES))
    assert evs[-1].type == "response.completed"
    assert evs[-1].response.output[0].type == "message"
    assert not any(e.type.startswith("response.function_call") for e in evs)
