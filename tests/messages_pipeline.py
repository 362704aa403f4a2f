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
BETA = "claude-code-20250219,interleaved-thinking-2025-05-14"
