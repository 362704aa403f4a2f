"""The OpenAI Agents SDK (``openai-agents``, pinned in pyproject.toml's dev
extra), unchanged, through a real pipeline: an agent with one function tool
runs its loop (the model calls the tool, the SDK runs it, sends its output
back, the model answers) over the Responses API and over chat completions
(``OpenAIChatCompletionsModel``), plain and streamed.

The model is the simulator with its test-only tool call
(``simulator.tool_call``), so the tool's arguments are known and the final
answer is checked against the text the simulator writes for the body the SDK
sent (a recording proxy in front of the edge keeps it). Tracing is off: the
SDK would otherwise export traces to OpenAI.
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

from tests.clients import Recorder, client_module, recording, simulator_text
from tests.pipeline import DEV_KEY, Pipeline, running_pipeline
from tidegate.config import SimulatorConfig
from tidegate.wire.protocol import Api

pytestmark = pytest.mark.pipeline

os.environ.setdefault("OPENAI_AGENTS_DISABLE_TRACING", "1")
openai = client_module("openai")
agents = client_module("agents")

SIM = SimulatorConfig(ttft=0.01, tokens_per_second=400.0, length=24)
ARGUMENTS = {"city": "Paris"}


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory: pytest.TempPathFactory, module_nats_url: str,
             module_redis_url: str) -> Iterator[Pipeline]:
    models: list[dict[str, Any]] = [{"name": "sim-tools", "simulator": {
        "ttft": SIM.ttft, "tokens_per_second": SIM.tokens_per_second, "length": SIM.length,
        "tool_call": "get_weather", "tool_arguments": json.dumps(ARGUMENTS)}}]
    yield from running_pipeline(tmp_path_factory.mktemp("agents"), module_nats_url,
                                module_redis_url, overrides={
                                    "models": models,
                                    "nats": {"subject_prefix": "ag" + uuid.uuid4().hex[:6]}})


@pytest.fixture
async def proxied(pipeline: Pipeline) -> AsyncIterator[tuple[Recorder, Any]]:
    agents.set_tracing_disabled(True)
    async with recording(pipeline.url) as (proxy, url), openai.AsyncOpenAI(
            base_url=f"{url}/v1", api_key=DEV_KEY, max_retries=0, timeout=60) as client:
        yield proxy, client


def weather_agent(model: Any, calls: list[str]) -> Any:
    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        calls.append(city)
        return f"Sunny in {city}, 21 C"

    return agents.Agent(name="weather", instructions="Answer with the weather.",
                        tools=[get_weather], model=model)


def model_for(api: str, client: Any) -> Any:
    if api == "responses":
        return agents.OpenAIResponsesModel(model="sim-tools", openai_client=client)
    return agents.OpenAIChatCompletionsModel(model="sim-tools", openai_client=client)


def check_loop(proxy: Recorder, api: str, calls: list[str]) -> tuple[Api, dict[str, Any]]:
    """Two requests: the first listed the tool, the second carried its output."""
    assert calls == ["Paris"]
    path, kind = (("/v1/responses", Api.RESPONSES) if api == "responses"
                  else ("/v1/chat/completions", Api.CHAT))
    first, second = proxy.to(path)
    assert not proxy.refused()
    if kind == Api.RESPONSES:
        assert [t["name"] for t in first.body["tools"]] == ["get_weather"]
        [output] = [i for i in second.body["input"] if i.get("type") == "function_call_output"]
        assert output["output"] == "Sunny in Paris, 21 C"
    else:
        assert [t["function"]["name"] for t in first.body["tools"]] == ["get_weather"]
        assert second.body["messages"][-1]["role"] == "tool"
        assert second.body["messages"][-1]["content"] == "Sunny in Paris, 21 C"
    return kind, second.body


@pytest.mark.parametrize("api", ["responses", "chat_completions"])
async def test_agent_run_with_a_function_tool(proxied: tuple[Recorder, Any], api: str) -> None:
    proxy, client = proxied
    calls: list[str] = []
    result = await agents.Runner.run(weather_agent(model_for(api, client), calls),
                                     "What is the weather in Paris?")
    kind, sent = check_loop(proxy, api, calls)
    assert result.final_output == await simulator_text(kind, sent, SIM)
    [call] = [i for i in result.new_items if i.type == "tool_call_item"]
    assert json.loads(call.raw_item.arguments) == ARGUMENTS
    usage = result.context_wrapper.usage
    assert usage.requests == 2
    assert usage.output_tokens > SIM.length  # the call's argument tokens, then the text


@pytest.mark.parametrize("api", ["responses", "chat_completions"])
async def test_agent_run_streamed(proxied: tuple[Recorder, Any], api: str) -> None:
    proxy, client = proxied
    calls: list[str] = []
    result = agents.Runner.run_streamed(weather_agent(model_for(api, client), calls),
                                        "What is the weather in Paris?")
    text = ""
    async for event in result.stream_events():
        if event.type == "raw_response_event":
            data = event.data
            if getattr(data, "type", "") == "response.output_text.delta":
                text += data.delta
    kind, sent = check_loop(proxy, api, calls)
    expected = await simulator_text(kind, sent, SIM)
    assert text == expected
    assert result.final_output == expected
