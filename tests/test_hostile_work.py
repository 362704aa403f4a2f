"""A tenant's request must not stall a worker's event loop (issue 44, rows 2
and 3), against a real pipeline whose worker samples its own loop lag
(``tests.faults.lag_probe``): while a hostile request runs, another tenant's
stream on the same worker goes on, and the worker's loop lag stays within
50 ms of what the loop shows with no hostile request at all.

The hostile requests: the issue's own (refused at the edge now) and the
largest of each kind the edge admits (bounded and off the loop at the worker).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.pipeline import DEV_KEY, Pipeline, running_pipeline

pytestmark = pytest.mark.pipeline

MSG = [{"role": "user", "content": "hi"}]
NORMAL_TOKENS = 120  # at 80 tokens/s: a 1.5 s stream beside the hostile request
MARGIN = 0.05  # the bound on what a hostile request may add to the loop's lag

HOSTILE: dict[str, tuple[str, dict[str, Any], int]] = {
    # name: (path, body, status)
    "stop_at_the_edge_bound": ("/v1/chat/completions", {
        "messages": MSG, "stream": True, "max_tokens": 262144, "stop": ["x" * 1000] * 4}, 200),
    "embeddings_at_the_edge_bound": ("/v1/embeddings", {
        "input": ["x"] * 113, "dimensions": 3072}, 200),
    "stop_of_issue_44": ("/v1/chat/completions", {
        "messages": MSG, "max_tokens": 262144, "stop": ["x" * 120_000] * 4}, 400),
    "embeddings_of_issue_44": ("/v1/embeddings", {
        "input": ["x"] * 2048, "dimensions": 8192}, 400),
}


@pytest.fixture(scope="module")
def probed(tmp_path_factory: pytest.TempPathFactory, module_nats_url: str,
           module_redis_url: str) -> Iterator[tuple[Pipeline, Path]]:
    workdir = tmp_path_factory.mktemp("hostile")
    lags = workdir / "loop-lag"
    sim = {"ttft": 0.01, "tokens_per_second": 80.0, "length": 8}
    for pipeline in running_pipeline(
            workdir, module_nats_url, module_redis_url,
            overrides={"models": [{"name": "tidegate-sim", "simulator": sim}]},
            worker_launcher=("tests.faults.lag_probe", str(lags))):
        yield pipeline, lags


def worst_lag(lags: Path, start: float, end: float) -> float:
    """The worker's worst loop lag reported for [start, end]; a loop that
    still stands still at ``end`` has reported nothing since it stopped."""
    rows = [tuple(map(float, line.split())) for line in lags.read_text().splitlines()]
    seen = [lag for t, lag in rows if start <= t <= end + 0.2]
    last = max(t for t, _ in rows)
    return max([*seen, time.monotonic() - last - 0.2, 0.0])


async def normal_stream(session: aiohttp.ClientSession, url: str) -> float:
    """Another tenant's stream: it must end with [DONE]; its worst gap between chunks."""
    body = {"model": "tidegate-sim", "messages": MSG, "stream": True,
            "max_tokens": NORMAL_TOKENS}
    async with session.post(url + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        gap, last, lines = 0.0, time.monotonic(), []
        async for line in resp.content:
            now = time.monotonic()
            gap, last = max(gap, now - last), now
            lines.append(line)
    assert lines[-2:] == [b"data: [DONE]\n", b"\n"], lines[-4:]
    return gap


async def hostile(session: aiohttp.ClientSession, url: str, path: str, body: dict[str, Any],
                  status: int) -> None:
    async with session.post(url + path, json={"model": "tidegate-sim", **body}) as resp:
        assert resp.status == status, (await resp.read())[:300]
        if status == 400:
            error = json.loads(await resp.read())["error"]
            assert error["param"] in ("stop", "dimensions"), error
        elif body.get("stream"):
            assert (await resp.content.readline()).startswith(b"data: ")  # then hang up
        else:
            # Counted, not parsed: parsing 7 MB would stall the other stream's reader.
            raw = await resp.read()
            assert raw.count(b'"object":"embedding"') == len(body["input"]), raw[-300:]


@pytest.mark.parametrize("name", list(HOSTILE))
async def test_a_hostile_request_does_not_stall_the_worker(
        probed: tuple[Pipeline, Path], name: str) -> None:
    """Each try measures the loop alone (a normal stream), then beside the
    hostile request. A stall the request causes shows in every try (on main:
    0.5 s to 100 s each); the box's own noise (a 100 ms hiccup of a loaded
    machine) is not in all three, so one try within the bound passes."""
    pipeline, lags = probed
    path, body, status = HOSTILE[name]
    headers = {"Authorization": f"Bearer {DEV_KEY}"}
    timeout = aiohttp.ClientTimeout(total=20)
    tries: list[tuple[float, float]] = []
    async with aiohttp.ClientSession(headers=headers, timeout=timeout) as session:
        while len(tries) < 3 and not any(busy < quiet + MARGIN for busy, quiet in tries):
            start = time.monotonic()
            quiet_gap = await normal_stream(session, pipeline.url)
            quiet = worst_lag(lags, start, time.monotonic())
            start = time.monotonic()
            stream = asyncio.ensure_future(normal_stream(session, pipeline.url))
            await asyncio.sleep(0.3)  # the stream is under way on the worker
            await hostile(session, pipeline.url, path, body, status)
            busy_gap = await stream
            tries.append((worst_lag(lags, start, time.monotonic()), quiet))
            print(f"{name}: worker loop lag {tries[-1][0] * 1000:.1f} ms (alone "
                  f"{quiet * 1000:.1f} ms); the other stream's worst gap "
                  f"{busy_gap * 1000:.1f} ms (alone {quiet_gap * 1000:.1f} ms)")
    assert any(busy < quiet + MARGIN for busy, quiet in tries), tries
