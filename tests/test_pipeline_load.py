"""Many concurrent streams, and a dispatcher killed mid-load, on real servers."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from tests.pipeline import DEV_KEY, Pipeline, running_pipeline
from tidegate.wire.protocol import Api, Request
from workers.backends.simulator import SimulatorBackend

pytestmark = pytest.mark.pipeline


@pytest.fixture
def pipeline(tmp_path: Path, nats_server: object, redis_server: object) -> Iterator[Pipeline]:
    yield from running_pipeline(
        tmp_path, nats_server.url, redis_server.url,  # type: ignore[attr-defined]
        overrides={"models": [{"name": "tidegate-sim", "max_streams": 256,
                               "simulator": {"ttft": 0.05, "tokens_per_second": 100.0,
                                             "length": 32}}]})


async def expected_text(pipeline: Pipeline, prompt: str, max_tokens: int) -> str:
    """What the deterministic simulator says to ``prompt``, computed in-process."""
    model = pipeline.config.models[0]
    fast = type(model.simulator)(ttft=0.0, tokens_per_second=1e6, length=model.simulator.length)
    backend = SimulatorBackend(type(model)(name=model.name, simulator=fast))
    request = Request(id="expected", reply="-", model=model.name, api=Api.CHAT, stream=False,
                      body={"model": model.name, "max_tokens": max_tokens,
                            "messages": [{"role": "user", "content": prompt}]},
                      created_ms=0, deadline_ms=0, window_bytes=1 << 20, window_msgs=1024)
    stream = await backend.open(request)
    body = b""
    while chunk := await stream.read(1 << 20):
        body += chunk
    await stream.aclose()
    content: str = json.loads(body)["choices"][0]["message"]["content"]
    return content


async def stream_chat(session: aiohttp.ClientSession, url: str, prompt: str,
                      max_tokens: int) -> tuple[str, list[str]]:
    """Returns (content, raw event lines) of one streaming request."""
    body = {"model": "tidegate-sim", "stream": True, "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": prompt}]}
    async with session.post(f"{url}/v1/chat/completions", json=body,
                            headers={"Authorization": f"Bearer {DEV_KEY}"}) as resp:
        text = await resp.text()
        if resp.status != 200:
            return f"HTTP {resp.status}: {text}", []
    events = [line[6:] for line in text.split("\n") if line.startswith("data: ")]
    content = ""
    for event in events:
        if event == "[DONE]":
            continue
        payload = json.loads(event)
        if "error" in payload:
            return f"ERROR {payload['error']}", events
        for choice in payload["choices"]:
            content += choice["delta"].get("content") or ""
    return content, events


async def test_200_concurrent_streams_complete_in_order(pipeline: Pipeline) -> None:
    n, max_tokens = 200, 24
    prompts = [f"request number {i}" for i in range(n)]
    expected = {p: await expected_text(pipeline, p, max_tokens) for p in prompts}
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        results = await asyncio.gather(
            *(stream_chat(session, pipeline.url, p, max_tokens) for p in prompts))
    wrong = [(p, got) for p, (got, _) in zip(prompts, results, strict=True)
             if got != expected[p]]
    assert not wrong, f"{len(wrong)} of {n} streams wrong, e.g. {wrong[:2]}"
    for _, events in results:
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
    # Distinct prompts really gave distinct texts, so a mixed-up stream would show.
    assert len(set(expected.values())) > n // 2


async def test_dispatcher_killed_and_restarted_loses_nothing(pipeline: Pipeline) -> None:
    n, max_tokens = 60, 16
    prompts = [f"survivor {i}" for i in range(n)]
    expected = {p: await expected_text(pipeline, p, max_tokens) for p in prompts}
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def staggered(i: int, prompt: str) -> tuple[str, list[str]]:
            await asyncio.sleep(i * 0.05)  # requests keep arriving across the outage
            return await stream_chat(session, pipeline.url, prompt, max_tokens)

        load = asyncio.gather(*(staggered(i, p) for i, p in enumerate(prompts)))
        await asyncio.sleep(0.8)
        pipeline.dispatcher.kill()  # SIGKILL: no chance to ack or clean up
        killed_at = time.monotonic()
        await asyncio.sleep(1.5)
        await asyncio.to_thread(pipeline.dispatcher.spawn)
        results = await load
    assert time.monotonic() - killed_at < 110, "requests hung"
    completed = sum(1 for p, (got, _) in zip(prompts, results, strict=True)
                    if got == expected[p])
    failures = [got for p, (got, _) in zip(prompts, results, strict=True) if got != expected[p]]
    # No request may be lost or corrupted: each either completes exactly or
    # ends with a clear error. With a quick restart, all of them complete.
    for got in failures:
        assert got.startswith(("HTTP 5", "ERROR")), f"neither complete nor a clear error: {got!r}"
    assert completed == n, f"{n - completed} requests failed: {failures[:3]}"
