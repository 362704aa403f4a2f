"""Shared pipeline and helpers of the Messages API tests (test_pipeline_messages*.py):
Anthropic's Messages API (POST /v1/messages) through edge -> JetStream ->
dispatcher -> worker, with the official ``anthropic`` SDK (a client nobody
here wrote), in both modes:

* translation: the simulator, and a fake backend that serves chat only
  (``messages=False``: ``auto`` learns to translate);
* passthrough: the fake backend's own /v1/messages, relayed byte for byte.

"Usage equal to the backend's": for the simulator, the same request run
through ``SimulatorBackend`` in this process; for the fake backend, what it
reported (prompt characters / 4, the tokens it sent).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Iterator, Mapping
from pathlib import Path
from typing import Any

import aiohttp
import anthropic
import pytest

from bench.fake_backend import FakeBackend, FakeConfig
from tests.pipeline import DEV_KEY, Pipeline, running_pipeline, threaded_fake_backend
from tidegate.config import ModelConfig, SimulatorConfig
from tidegate.wire.protocol import Api, Request
from workers.backends.simulator import SimulatorBackend

SIM = SimulatorConfig(ttft=0.01, tokens_per_second=400.0, length=24)
FAKE_TOKENS = 12


@pytest.fixture(scope="module")
def native() -> Iterator[FakeBackend]:
    """A backend that serves /v1/messages itself (as vLLM and llama-server do)."""
    with threaded_fake_backend(config=FakeConfig(models=("fake-model",), ttft=0.01, itl=0.002,
                                                 tokens=FAKE_TOKENS,
                                                 keep_output=True)) as backend:
        yield backend


@pytest.fixture(scope="module")
def chat_only() -> Iterator[FakeBackend]:
    """A backend that serves chat only, and answers a request with tools by a call."""
    with threaded_fake_backend(config=FakeConfig(models=("fake-model",), ttft=0.01, itl=0.002,
                                                 tokens=FAKE_TOKENS, messages=False,
                                                 tool_calls=True)) as backend:
        yield backend


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory: pytest.TempPathFactory, module_nats_url: str,
             module_redis_url: str, native: FakeBackend,
             chat_only: FakeBackend) -> Iterator[Pipeline]:
    workdir: Path = tmp_path_factory.mktemp("messages")
    models: list[dict[str, Any]] = [
        {"name": "tidegate-sim", "aliases": ["sim"],
         "simulator": {"ttft": SIM.ttft, "tokens_per_second": SIM.tokens_per_second,
                       "length": SIM.length}},
        {"name": "native", "backend": "openai", "base_url": native.base_url,
         "upstream_model": "fake-model", "messages": "passthrough"},
        {"name": "native-translated", "backend": "openai", "base_url": native.base_url,
         "upstream_model": "fake-model", "messages": "translate"},
        {"name": "chat-only", "backend": "openai", "base_url": chat_only.base_url,
         "upstream_model": "fake-model"},  # messages = "auto"
    ]
    yield from running_pipeline(workdir, module_nats_url, module_redis_url,
                                overrides={"models": models,
                                           "nats": {"subject_prefix": "m" + uuid.uuid4().hex[:6]}})


@pytest.fixture
async def client(pipeline: Pipeline) -> AsyncIterator[anthropic.AsyncAnthropic]:
    async with anthropic.AsyncAnthropic(base_url=pipeline.url, api_key=DEV_KEY,
                                        max_retries=0, timeout=30) as c:
        yield c


async def simulated(body: dict[str, Any], stream: bool) -> tuple[bytes, Any]:
    """What the simulator itself answers to a Messages ``body`` (bytes, usage)."""
    backend = SimulatorBackend(ModelConfig(name="tidegate-sim", simulator=SIM))
    request = Request(id="x", reply="r", model="tidegate-sim", api=Api.MESSAGES, stream=stream,
                      body={**body, "stream": stream}, created_ms=0, deadline_ms=0,
                      window_bytes=1, window_msgs=1)
    s = await backend.open(request)
    out = b""
    while data := await s.read(1 << 20):
        out += data
    return out, s.usage


HELLO = [{"role": "user", "content": "Tell me about tides"}]


async def post(pipeline: Pipeline, body: Any, headers: dict[str, str],
                path: str = "/v1/messages") -> tuple[int, Mapping[str, str], Any]:
    async with aiohttp.ClientSession() as session, session.post(
            f"{pipeline.url}{path}", headers=headers,
            data=body if isinstance(body, bytes) else json.dumps(body)) as resp:
        raw = await resp.read()
        return resp.status, resp.headers.copy(), json.loads(raw) if raw else None


def anthropic_error(body: Any, kind: str) -> None:
    """``body`` is an error in Anthropic's shape, of type ``kind``."""
    assert body["type"] == "error"
    assert body["error"]["type"] == kind
    assert isinstance(body["error"]["message"], str)
    assert set(body["error"]) == {"type", "message"}



WEATHER = {"name": "get_weather", "description": "The weather somewhere",
           "input_schema": {"type": "object", "properties": {"query": {"type": "string"}},
                            "required": ["query"]}}
ARGUMENTS = '{"query":"aaabbbccc"}'  # what the fake's tool call writes (fake_messages)
# What Claude Code 2.1.332 (tests/test_claude_code.py runs it) sends as
# anthropic-beta on /v1/messages.
BETA = ("claude-code-20250219,interleaved-thinking-2025-05-14,context-management-2025-06-27,"
        "per-turn-control-2026-07-01,mid-conversation-tool-changes-2026-07-01,"
        "thinking-token-count-2026-05-13,advanced-tool-use-2025-11-20,effort-2025-11-24")
CLAUDE_CODE_HEADERS = {
    "anthropic-version": "2023-06-01",
    "anthropic-beta": BETA,
    "anthropic-dangerous-direct-browser-access": "true",
    "x-app": "cli",
    "user-agent": "claude-cli/2.1.332 (external, sdk-cli)",
    "x-claude-code-session-id": "00611efb-fb3c-45ec-8ba3-d72cc34c67f8",
    "x-stainless-lang": "js",
    "x-stainless-retry-count": "0",
    "x-stainless-timeout": "600",
}


def claude_code_body(model: str, turns: list[dict[str, Any]], tools: list[dict[str, Any]],
                     session: str) -> dict[str, Any]:
    """A /v1/messages body in the shape Claude Code 2.1.332 sends (its fields,
    their order and kinds of value, texts shortened): a billing line and
    cached system blocks, a ``system`` turn after the first user turn (the
    environment), ``thinking`` adaptive, ``context_management`` clearing
    thinking, ``output_config.effort``, ``metadata.user_id`` as a JSON text,
    a tool with ``defer_loading``."""
    first, *rest = turns
    environment = {"role": "system", "content": [
        {"type": "text", "text": "# Environment\n - Primary working directory: /tmp/x",
         "cache_control": {"type": "ephemeral"}}]}
    user_id = json.dumps({"device_id": "62246ef7", "account_uuid": "", "session_id": session},
                         separators=(",", ":"))
    return {"model": model, "messages": [first, environment, *rest],
            "system": [{"type": "text",
                        "text": "x-anthropic-billing-header: cc_version=2.1.332.1c9; "
                                "cc_entrypoint=sdk-cli;"},
                       {"type": "text", "text": "You are Claude Code.",
                        "cache_control": {"type": "ephemeral"}}],
            "tools": [*tools, {"name": "DeferredToolPlaceholder", "description": "Later",
                               "input_schema": {"type": "object", "properties": {}},
                               "defer_loading": True}],
            "metadata": {"user_id": user_id}, "max_tokens": 128000,
            "thinking": {"type": "adaptive", "display": "omitted"},
            "context_management": {"edits": [{"type": "clear_thinking_20251015",
                                              "keep": "all"}]},
            "output_config": {"effort": "medium"}, "stream": True}
