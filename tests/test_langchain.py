"""LangChain's chat models (``langchain-openai`` and ``langchain-anthropic``,
pinned in pyproject.toml's dev extra), unchanged, through a real pipeline:
``ChatOpenAI(...).stream`` (chat completions, and the Responses API with
``use_responses_api``), ``ChatAnthropic(...).stream`` (the Messages API), and
``bind_tools`` with a tool call round trip on each.

The model is the simulator with its test-only tool call
(``simulator.tool_call``); each answer is checked against the text the
simulator writes for the body LangChain sent (a recording proxy in front of
the edge keeps it), the tool call against its configured arguments. The
synchronous ``stream`` runs in a thread, so the proxy's loop goes on.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

from tests.clients import Recorder, client_module, recording, simulator_text
from tests.pipeline import DEV_KEY, Pipeline, running_pipeline
from tidegate.config import SimulatorConfig
from tidegate.wire.protocol import Api

pytestmark = pytest.mark.pipeline

langchain_openai = client_module("langchain_openai")
langchain_anthropic = client_module("langchain_anthropic")
messages = client_module("langchain_core.messages")
tools = client_module("langchain_core.tools")

SIM = SimulatorConfig(ttft=0.01, tokens_per_second=400.0, length=24)
ARGUMENTS = {"city": "Paris"}
QUESTION = "What is the weather in Paris?"


def get_weather(city: str) -> str:
    """The weather in a city."""
    return f"Sunny in {city}, 21 C"


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory: pytest.TempPathFactory, module_nats_url: str,
             module_redis_url: str) -> Iterator[Pipeline]:
    simulator = {"ttft": SIM.ttft, "tokens_per_second": SIM.tokens_per_second,
                 "length": SIM.length}
    models: list[dict[str, Any]] = [
        {"name": "tidegate-sim", "simulator": simulator},
        {"name": "sim-tools", "simulator": {**simulator, "tool_call": "get_weather",
                                            "tool_arguments": json.dumps(ARGUMENTS)}},
    ]
    yield from running_pipeline(tmp_path_factory.mktemp("langchain"), module_nats_url,
                                module_redis_url, overrides={
                                    "models": models,
                                    "nats": {"subject_prefix": "lc" + uuid.uuid4().hex[:6]}})


@pytest.fixture
async def proxy(pipeline: Pipeline) -> AsyncIterator[tuple[Recorder, str]]:
    async with recording(pipeline.url) as proxy_url:
        yield proxy_url


def chat_openai(url: str, model: str, **kwargs: Any) -> Any:
    return langchain_openai.ChatOpenAI(model=model, base_url=f"{url}/v1", api_key=DEV_KEY,
                                       max_retries=0, timeout=60, **kwargs)


def chat_anthropic(url: str, model: str) -> Any:
    # No /v1: the anthropic SDK under it adds /v1/messages.
    return langchain_anthropic.ChatAnthropic(model=model, base_url=url, api_key=DEV_KEY,
                                             max_retries=0, timeout=60, max_tokens=64)


def text_of(chunks: list[Any]) -> str:
    """The text of streamed chunks (content may be a string or a list of blocks)."""
    total = chunks[0]
    for chunk in chunks[1:]:
        total = total + chunk
    return str(total.text)


# Where each chat model's requests go, and the simulator dialect that answers them.
ROUTES = {"chat": ("/v1/chat/completions", Api.CHAT), "responses": ("/v1/responses",
                                                                     Api.RESPONSES),
          "messages": ("/v1/messages", Api.MESSAGES)}


def make(kind: str, url: str, model: str) -> Any:
    if kind == "messages":
        return chat_anthropic(url, model)
    return chat_openai(url, model, stream_usage=True, use_responses_api=kind == "responses")


@pytest.mark.parametrize("kind", ["chat", "responses", "messages"])
async def test_stream(proxy: tuple[Recorder, str], kind: str) -> None:
    recorder, url = proxy
    llm = make(kind, url, "tidegate-sim")
    chunks = await asyncio.to_thread(lambda: list(llm.stream(QUESTION)))
    path, api = ROUTES[kind]
    [sent] = recorder.to(path)
    assert sent.body["stream"] is True
    assert len(chunks) > SIM.length // 2  # streamed, not one piece
    assert text_of(chunks) == await simulator_text(api, sent.body, SIM)
    usage = sum(chunks[1:], chunks[0]).usage_metadata
    assert usage is not None
    assert usage["output_tokens"] == SIM.length
    assert usage["input_tokens"] > 0
    assert not recorder.refused()


@pytest.mark.parametrize("kind", ["chat", "responses", "messages"])
async def test_bind_tools_round_trip(proxy: tuple[Recorder, str], kind: str) -> None:
    recorder, url = proxy
    weather = tools.tool(get_weather)
    llm = make(kind, url, "sim-tools").bind_tools([weather])
    asked = messages.HumanMessage(QUESTION)
    call = await llm.ainvoke([asked])
    [tool_call] = call.tool_calls
    assert tool_call["name"] == "get_weather"
    assert tool_call["args"] == ARGUMENTS
    result = await weather.ainvoke(tool_call)  # a ToolMessage with the call's id
    assert result.tool_call_id == tool_call["id"]
    answer = await llm.ainvoke([asked, call, result])
    assert not answer.tool_calls
    path, api = ROUTES[kind]
    first, second = recorder.to(path)
    assert "get_weather" in json.dumps(first.body["tools"])
    assert "Sunny in Paris, 21 C" in json.dumps(second.body)
    assert answer.text == await simulator_text(api, second.body, SIM)
    assert not recorder.refused()
