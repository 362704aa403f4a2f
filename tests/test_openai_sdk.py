"""The ``openai`` Python SDK (pinned in pyproject.toml's dev extra), unchanged,
pointed at a real pipeline with ``base_url``: what the other files that drive
it leave out. Tool calls (chat, plain and with the SDK's stream helper and
its parsed arguments; Responses function calls, plain and streamed) round
trip through the simulator's test-only tool call, and the request fields
today's SDK sends are accepted. Each answer is checked against the text,
call and usage the simulator writes for the body the SDK sent (a recording
proxy in front of the edge keeps it).

The rest of the SDK's surface is driven elsewhere, through the same kind of
pipeline: chat and completions, plain and streamed
(``tests/test_pipeline_openai.py``), Responses and embeddings
(``tests/test_pipeline_responses.py``), background responses, retrieve and
the resumed stream (``tests/test_background_responses.py``), files and
batches (``tests/test_batch_pipeline.py``). docs/clients.md lists them.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from pydantic import BaseModel

from tests.clients import Recorder, client_module, recording, simulator_text
from tests.pipeline import DEV_KEY, Pipeline, running_pipeline
from tidegate.config import SimulatorConfig
from tidegate.wire.protocol import Api

pytestmark = pytest.mark.pipeline

openai = client_module("openai")

SIM = SimulatorConfig(ttft=0.01, tokens_per_second=400.0, length=24)
ARGUMENTS = {"city": "Paris", "unit": "celsius"}
TOOL_SIM = {"ttft": SIM.ttft, "tokens_per_second": SIM.tokens_per_second, "length": SIM.length,
            "tool_call": "get_weather", "tool_arguments": json.dumps(ARGUMENTS)}
CHAT_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"type": "string"}},
                   "required": ["city", "unit"]}}}
RESPONSES_TOOL = {"type": "function", "name": "get_weather", "description": "The weather.",
                  "parameters": CHAT_TOOL["function"]["parameters"],  # type: ignore[index]
                  "strict": False}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


class GetWeather(BaseModel):
    """The weather in a city."""

    city: str
    unit: str


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory: pytest.TempPathFactory, module_nats_url: str,
             module_redis_url: str) -> Iterator[Pipeline]:
    models: list[dict[str, Any]] = [
        {"name": "tidegate-sim", "simulator": {
            "ttft": SIM.ttft, "tokens_per_second": SIM.tokens_per_second, "length": SIM.length}},
        {"name": "sim-tools", "simulator": TOOL_SIM},
    ]
    yield from running_pipeline(tmp_path_factory.mktemp("openai_sdk"), module_nats_url,
                                module_redis_url, overrides={
                                    "models": models,
                                    "nats": {"subject_prefix": "o" + uuid.uuid4().hex[:6]}})


@pytest.fixture
async def proxied(pipeline: Pipeline) -> AsyncIterator[tuple[Recorder, Any]]:
    """The recording proxy and an ``AsyncOpenAI`` client pointed at it."""
    async with recording(pipeline.url) as (proxy, url), openai.AsyncOpenAI(
            base_url=f"{url}/v1", api_key=DEV_KEY, max_retries=0, timeout=60) as client:
        yield proxy, client


def _tool_result(call_id: str) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": call_id, "content": "Sunny, 21 C"}


async def test_chat_tool_call_round_trip(proxied: tuple[Recorder, Any]) -> None:
    proxy, client = proxied
    first = await client.chat.completions.create(model="sim-tools", messages=ASK,
                                                 tools=[CHAT_TOOL])
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == ARGUMENTS
    assert first.usage.completion_tokens > 0
    # The result goes back; the answer is the simulator's text for that body.
    second = await client.chat.completions.create(
        model="sim-tools", tools=[CHAT_TOOL],
        messages=[*ASK, choice.message.model_dump(exclude_none=True), _tool_result(call.id)])
    assert second.choices[0].finish_reason == "stop"
    sent = proxy.to("/v1/chat/completions")[-1].body
    assert sent["messages"][-1]["role"] == "tool"
    assert second.choices[0].message.content == await simulator_text(Api.CHAT, sent, SIM)
    assert second.usage.completion_tokens == SIM.length
    assert not proxy.refused()


async def test_chat_stream_helper_parses_a_strict_tool(proxied: tuple[Recorder, Any]) -> None:
    """``chat.completions.stream`` with ``pydantic_function_tool``: the call's
    arguments arrive in pieces and the SDK parses them into the model."""
    proxy, client = proxied
    async with client.chat.completions.stream(
            model="sim-tools", messages=ASK, tools=[openai.pydantic_function_tool(
                GetWeather, name="get_weather")],
            stream_options={"include_usage": True}) as stream:
        deltas = [e.arguments_delta async for e in stream
                  if e.type == "tool_calls.function.arguments.delta" and e.arguments_delta]
        final = await stream.get_final_completion()
    assert len(deltas) > 1
    assert json.loads("".join(deltas)) == ARGUMENTS
    [call] = final.choices[0].message.tool_calls
    assert call.function.parsed_arguments == GetWeather(**ARGUMENTS)
    assert final.choices[0].finish_reason == "tool_calls"
    assert final.usage.completion_tokens == len(deltas)
    [sent] = proxy.to("/v1/chat/completions")
    assert sent.body["tools"][0]["function"]["strict"] is True
    assert not proxy.refused()


async def test_responses_function_call_round_trip(proxied: tuple[Recorder, Any]) -> None:
    proxy, client = proxied
    first = await client.responses.create(model="sim-tools", input=ASK, tools=[RESPONSES_TOOL])
    assert first.status == "completed"
    [call] = first.output
    assert call.type == "function_call"
    assert call.name == "get_weather"
    assert json.loads(call.arguments) == ARGUMENTS
    assert first.output_text == ""
    follow = [*ASK, call.model_dump(exclude_none=True),
              {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"}]
    async with client.responses.stream(model="sim-tools", input=follow,
                                       tools=[RESPONSES_TOOL]) as stream:
        pieces = [e.delta async for e in stream if e.type == "response.output_text.delta"]
        final = await stream.get_final_response()
    sent = proxy.to("/v1/responses")[-1].body
    assert final.output_text == "".join(pieces) == await simulator_text(Api.RESPONSES, sent, SIM)
    assert final.usage.output_tokens == SIM.length
    assert not proxy.refused()


async def test_responses_function_call_streamed(proxied: tuple[Recorder, Any]) -> None:
    proxy, client = proxied
    stream = await client.responses.create(model="sim-tools", input="Weather in Paris?",
                                           tools=[RESPONSES_TOOL], stream=True)
    events = [event async for event in stream]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert len(deltas) > 1
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert [json.loads(e.arguments) for e in done] == [ARGUMENTS]
    final = events[-1]
    assert final.type == "response.completed"
    assert final.response.output[0].name == "get_weather"
    assert final.response.usage.output_tokens == len(deltas)
    assert not proxy.refused()


async def test_todays_request_fields_are_accepted(proxied: tuple[Recorder, Any]) -> None:
    """Fields of today's SDK that only annotate a request, or that a backend
    serves: none is a 400 (docs/backends.md lists what happens to each)."""
    proxy, client = proxied
    chat = await client.chat.completions.create(
        model="tidegate-sim", messages=[{"role": "developer", "content": "Be brief."}, *ASK],
        store=False, metadata={"run": "clients"}, prompt_cache_key="clients-test",
        safety_identifier="user-1", service_tier="auto", verbosity="low",
        reasoning_effort="low", parallel_tool_calls=False, tools=[CHAT_TOOL],
        tool_choice="auto", user="user-1", seed=7, max_completion_tokens=16, temperature=0.5,
        top_p=0.9, stop=["\n\n"], logprobs=False, modalities=["text"],
        response_format={"type": "text"})
    assert chat.choices[0].message.content
    stream = await client.chat.completions.create(
        model="tidegate-sim", messages=ASK, stream=True,
        stream_options={"include_usage": True, "include_obfuscation": False})
    chunks = [chunk async for chunk in stream]
    assert chunks[-1].usage.completion_tokens == SIM.length
    response = await client.responses.create(
        model="tidegate-sim", input=ASK, instructions="Be brief.", store=False,
        metadata={"run": "clients"}, prompt_cache_key="clients-test",
        safety_identifier="user-1", service_tier="auto", include=[],
        reasoning={"effort": "low"}, text={"format": {"type": "text"}, "verbosity": "low"},
        max_tool_calls=2, parallel_tool_calls=False, tools=[RESPONSES_TOOL],
        tool_choice="auto", truncation="disabled", max_output_tokens=16, temperature=0.5,
        top_p=0.9, user="user-1")
    assert response.status == "incomplete"  # max_output_tokens cut it
    assert response.usage.output_tokens == 16
    assert not proxy.refused()
