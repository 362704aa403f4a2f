"""While interactive streams run, batch holds only ``batch.share_under_load`` of
the slots they leave free (dispatcher/batch/room.py), and takes every free
slot again once they end."""

from __future__ import annotations

import asyncio
import io
import json
import time
from collections.abc import AsyncIterator, Iterator

import openai
import pytest

from tests.pipeline import DEV_KEY, Pipeline, paced_simulator, running_pipeline

pytestmark = pytest.mark.pipeline

SLOTS = 20
TOKENS_PER_SECOND = 20.0
INTERACTIVE = 4
INTERACTIVE_TOKENS = 100  # 5 s each: the batch starts while they run
LINE_TOKENS = 30  # 1.5 s a batch line
LINES = 24
SHARE = 0.05  # the default: ceil(0.05 * (20 - 4)) = 1 line at a time beside them


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory: pytest.TempPathFactory, module_nats_url: str,
             module_redis_url: str) -> Iterator[Pipeline]:
    yield from running_pipeline(
        tmp_path_factory.mktemp("batchshare"), module_nats_url, module_redis_url,
        overrides={"models": paced_simulator(SLOTS, TOKENS_PER_SECOND),
                   "batch": {"share_under_load": SHARE}})


@pytest.fixture
async def client(pipeline: Pipeline) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url=pipeline.base_url, api_key=DEV_KEY,
                                  max_retries=0, timeout=60) as c:
        yield c


async def test_batch_takes_a_share_beside_interactive_and_every_slot_after(
        client: openai.AsyncOpenAI) -> None:
    started = asyncio.Event()
    running = 0

    async def interactive(i: int) -> None:
        nonlocal running
        stream = await client.chat.completions.create(
            model="tidegate-sim", max_tokens=INTERACTIVE_TOKENS, stream=True,
            messages=[{"role": "user", "content": f"interactive {i}"}])
        first = True
        async for _ in stream:
            if first:
                first = False
                running += 1
                if running == INTERACTIVE:
                    started.set()

    streams = [asyncio.create_task(interactive(i)) for i in range(INTERACTIVE)]
    await asyncio.wait_for(started.wait(), 30)

    data = b"".join(json.dumps({
        "custom_id": f"s-{i}", "method": "POST", "url": "/v1/chat/completions",
        "body": {"model": "tidegate-sim", "max_tokens": LINE_TOKENS,
                 "messages": [{"role": "user", "content": f"batch {i}"}]}}).encode() + b"\n"
        for i in range(LINES))
    file = await client.files.create(file=("s.jsonl", io.BytesIO(data)), purpose="batch")
    batch = await client.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions",
                                        completion_window="24h")
    await asyncio.gather(*streams)
    beside = await client.batches.retrieve(batch.id)
    assert beside.request_counts is not None
    done_beside = beside.request_counts.completed
    ended_at = time.monotonic()
    deadline = ended_at + 60
    while (b := await client.batches.retrieve(batch.id)).status != "completed":
        assert time.monotonic() < deadline, b
        await asyncio.sleep(0.1)
    after = time.monotonic() - ended_at
    print(f"{done_beside}/{LINES} lines done beside {INTERACTIVE} interactive streams; "
          f"the rest took {after:.1f}s after they ended")
    # Beside them: one line at a time, 1.5 s each, for at most ~5 s. Every free
    # slot (16) would have finished 16 lines per 1.5 s.
    assert done_beside <= 4
    # After them: 20 slots; the rest (>= 20 lines) in two rounds of 1.5 s, not
    # one line at a time (>= 30 s).
    assert after < 12
