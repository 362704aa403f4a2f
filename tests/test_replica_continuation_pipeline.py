"""A backend replica that fails mid-stream while its worker lives (issue 25,
items 3 and 5), against real servers: a nats-server, a redis-server, the
tiers as processes, and fake backend replicas in the greedy deterministic
mode (token i = f(prompt, i), a trailing assistant message continued), so a
stream continued on the other replica is checked **byte-exact** against an
uninterrupted run of the same prompt.

The uninterrupted runs go to model ``whole``: the healthy replica alone,
under the upstream name of the model with replicas, so its chunks name the
same model and every byte can be compared.

The sans-I/O parts and the job's decisions are tests/test_replica_continuation.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from bench.fake_backend import FakeBackend, FakeConfig
from fleet.run.servers import free_port, http_ok
from tests.pipeline import DEV_KEY, Pipeline, stream, threaded_fake_backend, wait_for

MODEL = "two"
ROOT = Path(__file__).resolve().parent.parent
PACE = {"ttft": 0.05, "itl": 0.02, "tokens": 60, "deterministic": True}


def models(a_url: str, b_url: str) -> list[dict[str, Any]]:
    return [
        {"name": MODEL, "backend": "openai", "base_urls": [a_url, b_url],
         "failover": "continue", "max_streams": 64},
        # The healthy replica alone: the uninterrupted runs.
        {"name": "whole", "backend": "openai", "base_url": b_url, "upstream_model": MODEL,
         "max_streams": 64},
        # The failing replica alone: nowhere to go on.
        {"name": "solo", "backend": "openai", "base_url": a_url, "upstream_model": MODEL,
         "failover": "continue", "max_streams": 8},
    ]


def start_pipeline(tmp_path: Path, nats_url: str, redis_url: str, a_url: str,
                   b_url: str) -> Pipeline:
    p = Pipeline(tmp_path, nats_url, redis_url, overrides={
        "edge": {"request_timeout": 120.0},
        "models": models(a_url, b_url)})
    p.start()
    return p


def split_usage(raw: bytes) -> tuple[bytes, dict[str, Any] | None]:
    """The stream without its usage event, and that event's usage."""
    kept, usage = [], None
    for event in raw.split(b"\n\n"):
        if event.startswith(b"data: {") and b'"choices":[]' in event:
            usage = json.loads(event[6:])["usage"]
        else:
            kept.append(event)
    return b"\n\n".join(kept), usage


async def compare(session: aiohttp.ClientSession, url: str, texts: list[str],
                  got: list[tuple[bytes, float]]) -> None:
    """Each stream against an uninterrupted run of its prompt: every byte,
    and for those with a usage chunk, every byte but it and the same
    completion tokens (its prompt tokens count both calls' prompts)."""
    whole = await asyncio.wait_for(asyncio.gather(*(
        stream(session, url, "whole", t, usage=i % 2 == 0) for i, t in enumerate(texts))), 120)
    for i, ((raw, _), (expected, _)) in enumerate(zip(got, whole, strict=True)):
        assert raw.endswith(b"data: [DONE]\n\n"), raw[-400:]
        if i % 2:
            assert raw == expected, texts[i]
            continue
        events, usage = split_usage(raw)
        expected_events, expected_usage = split_usage(expected)
        assert events == expected_events, texts[i]
        assert usage is not None
        assert expected_usage is not None
        assert usage["completion_tokens"] == expected_usage["completion_tokens"], usage
        assert usage["prompt_tokens"] >= expected_usage["prompt_tokens"], usage


def continued_count(pipeline: Pipeline) -> int:
    return pipeline.log_text().count("failed mid-stream (")


# -- a replica that breaks every stream after 5 tokens ------------------------------------


@pytest.fixture(params=["drop", "error"])
def failing(request: pytest.FixtureRequest) -> Iterator[tuple[FakeBackend, FakeBackend]]:
    """Replica A fails every stream after its role chunk and 5 tokens: a
    truncated body (``drop``) or vLLM's error event for a 5xx (``error``)."""
    a_config = FakeConfig(**PACE, fail_after=6, fail_with=request.param)  # type: ignore[arg-type]
    with threaded_fake_backend(config=a_config) as a, \
            threaded_fake_backend(config=FakeConfig(**PACE)) as b:  # type: ignore[arg-type]
        yield a, b


@pytest.fixture
def pipeline(tmp_path: Path, nats_server: Any, redis_server: Any,
             failing: tuple[FakeBackend, FakeBackend]) -> Iterator[Pipeline]:
    a, b = failing
    p = start_pipeline(tmp_path, nats_server.url, redis_server.url, a.base_url, b.base_url)
    try:
        yield p
    finally:
        p.stop()


@pytest.mark.slow
@pytest.mark.pipeline
async def test_a_replica_failing_after_5_tokens_costs_no_stream_a_byte(
        pipeline: Pipeline, failing: tuple[FakeBackend, FakeBackend]) -> None:
    a, _ = failing
    texts = [f"replica-{i}-{uuid.uuid4().hex}" for i in range(30)]
    async with aiohttp.ClientSession() as session:
        got = await asyncio.wait_for(asyncio.gather(*(
            stream(session, pipeline.url, MODEL, t, usage=i % 2 == 0)
            for i, t in enumerate(texts))), 120)
        broken = [r for r in a.records if r.dropped]
        assert broken, "no stream met the failing replica"
        assert continued_count(pipeline) >= len(broken)
        print(f"{len(broken)} streams broken by replica A, {continued_count(pipeline)} continued")
        await compare(session, pipeline.url, texts, got)

        # (3) One replica: nowhere to go on, today's clean error.
        raw, _ = await stream(session, pipeline.url, "solo", f"solo-{uuid.uuid4().hex}")
        assert_error_end(raw)

        # (4) Not continuable (logprobs): the error stays, whichever replica
        # it runs on (the request itself asks both to fail after 5 tokens).
        raw, _ = await stream(session, pipeline.url, MODEL, f"lp-{uuid.uuid4().hex}",
                              logprobs=True, fake_fail_after=6)
        assert_error_end(raw)


@pytest.mark.slow
@pytest.mark.pipeline
@pytest.mark.parametrize("failing", ["drop"], indirect=True)
async def test_a_resumable_stream_goes_on_on_the_other_replica_and_in_its_log(
        pipeline: Pipeline, failing: tuple[FakeBackend, FakeBackend]) -> None:
    """Resumable streams through the replica that breaks after 5 tokens: the
    same job goes on on the other replica, so the client's stream and its
    log (a replay from event 0) read as one, byte-exact against an
    uninterrupted run once the event ids are set aside."""
    a, _ = failing
    texts = [f"resumable-{i}-{uuid.uuid4().hex}" for i in range(10)]
    resumable = {"X-Tidegate-Resumable": "true"}
    async with aiohttp.ClientSession() as session:
        rids: dict[str, str] = {}

        async def one(text: str) -> bytes:
            async with session.post(f"{pipeline.url}/v1/chat/completions", json={
                    "model": MODEL, "stream": True,
                    "messages": [{"role": "user", "content": text}]},
                    headers={"Authorization": f"Bearer {DEV_KEY}", **resumable}) as resp:
                assert resp.status == 200, await resp.text()
                rids[text] = resp.headers["x-request-id"]
                return await resp.read()

        got = await asyncio.wait_for(asyncio.gather(*(one(t) for t in texts)), 120)
        assert [r for r in a.records if r.dropped], "no stream met the failing replica"
        whole = await asyncio.wait_for(asyncio.gather(*(
            stream(session, pipeline.url, "whole", t) for t in texts)), 120)
        for text, raw, (expected, _) in zip(texts, got, whole, strict=True):
            async with session.get(f"{pipeline.url}/v1/streams/{rids[text]}", headers={
                    "Authorization": f"Bearer {DEV_KEY}", "Last-Event-ID": "0"}) as replay:
                assert await replay.read() == raw, text
            assert _without_ids(raw) == expected, text


def _without_ids(raw: bytes) -> bytes:
    """A resumable stream as a plain one reads: no ``id:``, ``retry:`` lines."""
    return re.sub(rb"(?m)^(id|retry): \d+\n", b"", raw.replace(b": ping\n\n", b""))


def assert_error_end(raw: bytes) -> None:
    events = [e[6:] for e in raw.split(b"\n\n") if e.startswith(b"data: ")]
    assert b"[DONE]" not in events, raw[-300:]
    assert len(events) >= 6, events  # the role chunk and 5 tokens reached the client
    error = json.loads(events[-1])["error"]
    assert error["code"] == "backend_error", error


# -- a replica process killed mid-stream under 30 streams --------------------------------


@contextlib.contextmanager
def fake_process(port: int) -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "bench.fake_backend", "--port", str(port), "--deterministic",
         "--ttft", str(PACE["ttft"]), "--itl", str(PACE["itl"]), "--tokens",
         str(PACE["tokens"])], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while not http_ok(f"http://127.0.0.1:{port}/v1/models"):
            assert proc.poll() is None, "the fake backend process exited"
            assert time.monotonic() < deadline, "the fake backend process did not serve"
            time.sleep(0.05)
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)


@pytest.mark.slow
@pytest.mark.pipeline
async def test_a_replica_process_killed_mid_stream_costs_30_streams_a_pause(
        tmp_path: Path, nats_server: Any, redis_server: Any) -> None:
    port = free_port()
    with fake_process(port) as proc, \
            threaded_fake_backend(config=FakeConfig(**PACE)) as b:  # type: ignore[arg-type]
        p = start_pipeline(tmp_path, nats_server.url, redis_server.url,
                           f"http://127.0.0.1:{port}/v1", b.base_url)
        try:
            texts = [f"kill-{i}-{uuid.uuid4().hex}" for i in range(30)]
            progress: dict[str, int] = {}
            async with aiohttp.ClientSession() as session:
                tasks = [asyncio.ensure_future(stream(session, p.url, MODEL, t,
                                                      usage=i % 2 == 0, progress=progress))
                         for i, t in enumerate(texts)]
                # Every stream under way, a few of its 60 tokens read (not a
                # sleep: on a busy machine the streams may not have started
                # by then, or the killed replica's may have ended).
                assert await wait_for(
                    lambda: len(progress) == len(texts) and min(progress.values()) >= 4, 60)
                os.kill(proc.pid, signal.SIGKILL)
                got = await asyncio.wait_for(asyncio.gather(*tasks), 120)
                moved = continued_count(p)
                assert moved, "no stream ran on the killed replica"
                await compare(session, p.url, texts, got)
            pauses = sorted(pause for _, pause in got)
            print(f"{moved} streams moved off the killed replica; longest pause per stream: "
                  f"p50 {statistics.median(pauses):.3f}s, max {pauses[-1]:.3f}s")
        finally:
            p.stop()
