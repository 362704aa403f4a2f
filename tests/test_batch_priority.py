"""Batch runs only on spare capacity: with batch work queued, an interactive
request starts within one worker slot's turnover, not behind the batch."""

from __future__ import annotations

import asyncio
import io
import json
import time
from collections.abc import AsyncIterator, Iterator

import nats
import openai
import pytest

from tests.pipeline import DEV_KEY, Pipeline, paced_simulator, running_pipeline
from tidegate.control.keys import create_key, ensure_keys_bucket

pytestmark = pytest.mark.pipeline

SLOTS = 2
TOKENS = 30
TOKENS_PER_SECOND = 20.0
LINE_SECONDS = TOKENS / TOKENS_PER_SECOND  # one batch line holds a slot this long
LINES = 16  # LINES / SLOTS * LINE_SECONDS = 12 s of batch work


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory: pytest.TempPathFactory, module_nats_url: str,
             module_redis_url: str) -> Iterator[Pipeline]:
    yield from running_pipeline(
        tmp_path_factory.mktemp("batchprio"), module_nats_url, module_redis_url,
        overrides={"models": paced_simulator(SLOTS, TOKENS_PER_SECOND)})


@pytest.fixture
async def client(pipeline: Pipeline) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url=pipeline.base_url, api_key=DEV_KEY,
                                  max_retries=0, timeout=60) as c:
        yield c


async def test_interactive_starts_within_one_slot_turnover(client: openai.AsyncOpenAI) -> None:
    data = b"".join(json.dumps({
        "custom_id": f"p-{i}", "method": "POST", "url": "/v1/chat/completions",
        "body": {"model": "tidegate-sim", "max_tokens": TOKENS,
                 "messages": [{"role": "user", "content": f"batch {i}"}]}}).encode() + b"\n"
        for i in range(LINES))
    file = await client.files.create(file=("p.jsonl", io.BytesIO(data)), purpose="batch")
    batch = await client.batches.create(input_file_id=file.id,
                                        endpoint="/v1/chat/completions",
                                        completion_window="24h")
    # Wait until the batch holds every slot and has more queued behind them.
    deadline = time.monotonic() + 30
    while True:
        b = await client.batches.retrieve(batch.id)
        if b.status == "in_progress" and b.request_counts and b.request_counts.completed >= 1:
            break
        assert time.monotonic() < deadline, b
        await asyncio.sleep(0.05)
    before = b.request_counts.completed if b.request_counts else 0
    assert before < LINES - 2 * SLOTS, "the batch ran too fast for the test to mean anything"

    start = time.monotonic()
    stream = await client.chat.completions.create(
        model="tidegate-sim", max_tokens=2, stream=True,
        messages=[{"role": "user", "content": "interactive"}])
    ttft = None
    async for chunk in stream:
        if ttft is None and chunk.choices and chunk.choices[0].delta.content:
            ttft = time.monotonic() - start
            during = await client.batches.retrieve(batch.id)
    assert ttft is not None
    done_meanwhile = (during.request_counts.completed if during.request_counts else 0) - before
    print(f"interactive TTFT {ttft:.2f}s with the batch holding every slot "
          f"(one line = {LINE_SECONDS:.1f}s); batch lines finished meanwhile: {done_meanwhile}")
    # Causality: it started when the first slot turned over; the batch did not
    # get any slot back first (at most each slot's running line finished; a
    # slot's read of the counts lags by up to one refresh, hence + 1).
    assert done_meanwhile <= SLOTS + 1
    # And in time: one line's duration plus the loaded machine's overheads,
    # far below the remaining batch (> 2 * SLOTS lines ahead = 2 line times per slot).
    assert ttft < LINE_SECONDS + 2.0
    final = await client.batches.retrieve(batch.id)
    assert final.status == "in_progress"  # the batch was still going: it did not block
    await client.batches.cancel(batch.id)  # free the slots for the next test


async def test_tenants_share_batch_capacity(pipeline: Pipeline, client: openai.AsyncOpenAI,
                                            module_nats_url: str) -> None:
    """A second tenant's batch, submitted behind a long one, gets lines in turn
    (round robin), not after the whole first batch."""
    nc = await nats.connect(module_nats_url)
    try:
        other_key, _ = await create_key(await ensure_keys_bucket(nc.jetstream(),
                                                                 pipeline.config), "tenant-b")
    finally:
        await nc.close()

    def lines(prefix: str, n: int) -> bytes:
        return b"".join(json.dumps({
            "custom_id": f"{prefix}-{i}", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "tidegate-sim", "max_tokens": TOKENS,
                     "messages": [{"role": "user", "content": f"{prefix} {i}"}]}}).encode()
            + b"\n" for i in range(n))

    async def submit(c: openai.AsyncOpenAI, data: bytes) -> str:
        file = await c.files.create(file=("f.jsonl", io.BytesIO(data)), purpose="batch")
        return (await c.batches.create(input_file_id=file.id,
                                       endpoint="/v1/chat/completions",
                                       completion_window="24h")).id

    long_id = await submit(client, lines("a", LINES))
    async with openai.AsyncOpenAI(base_url=pipeline.base_url, api_key=other_key,
                                  max_retries=0, timeout=60) as other:
        deadline = time.monotonic() + 10
        while True:  # the new key reaches the edge through its KV watch
            try:
                await other.files.list()
                break
            except openai.AuthenticationError:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.1)
        deadline = time.monotonic() + 30
        while (await client.batches.retrieve(long_id)).status != "in_progress":
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        short_id = await submit(other, lines("b", 2))
        deadline = time.monotonic() + 60
        while (short := await other.batches.retrieve(short_id)).status != "completed":
            assert time.monotonic() < deadline, short
            await asyncio.sleep(0.1)
    long = await client.batches.retrieve(long_id)
    assert long.request_counts is not None
    print(f"tenant b's 2 lines done while tenant a's batch had "
          f"{long.request_counts.completed}/{LINES} lines done")
    # FIFO would finish all of a's lines first; round robin interleaves b's two.
    assert long.status == "in_progress"
    assert long.request_counts.completed <= LINES // 2
    await client.batches.cancel(long_id)
