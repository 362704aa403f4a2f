"""Batches survive their tiers dying: kill -9 the worker, then the dispatcher
(which runs the batch runner), in the middle of a batch. It still completes,
and the output has every ``custom_id`` exactly once."""

from __future__ import annotations

import asyncio
import io
import json
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from typing import Any

import openai
import pytest

from fleet.run.servers import ManagedProcess
from tests.pipeline import DEV_KEY, Pipeline, running_pipeline

pytestmark = [pytest.mark.pipeline, pytest.mark.slow]

LINES = 48


@pytest.fixture
def pipeline(tmp_path_factory: pytest.TempPathFactory, module_nats_url: str,
             module_redis_url: str) -> Iterator[Pipeline]:
    models = [{"name": "tidegate-sim", "max_streams": 6,
               "simulator": {"ttft": 0.05, "tokens_per_second": 40.0, "length": 16}}]
    yield from running_pipeline(
        tmp_path_factory.mktemp("batchfaults"), module_nats_url, module_redis_url,
        overrides={"models": models, "batch": {"lease": 1.0}})


@pytest.fixture
async def client(pipeline: Pipeline) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url=pipeline.base_url, api_key=DEV_KEY,
                                  max_retries=2, timeout=30) as c:
        yield c


async def completed(client: openai.AsyncOpenAI, batch_id: str) -> tuple[str, int]:
    batch = await client.batches.retrieve(batch_id)
    return batch.status, batch.request_counts.completed if batch.request_counts else 0


async def until_more(client: openai.AsyncOpenAI, batch_id: str, than: int,
                     within: float = 60) -> int:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        status, done = await completed(client, batch_id)
        assert status in ("validating", "in_progress"), status
        if done > than:
            return done
        await asyncio.sleep(0.1)
    raise AssertionError(f"batch made no progress past {than} lines in {within}s")


async def test_kill_worker_then_dispatcher_mid_batch(pipeline: Pipeline,
                                                     client: openai.AsyncOpenAI) -> None:
    lines: list[dict[str, Any]] = [
        {"custom_id": f"k-{i}", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": "tidegate-sim", "max_tokens": 16,
                  "messages": [{"role": "user", "content": f"line {i}"}]}}
        for i in range(LINES)]
    data = b"".join(json.dumps(line).encode() + b"\n" for line in lines)
    file = await client.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch")
    batch = await client.batches.create(input_file_id=file.id,
                                        endpoint="/v1/chat/completions",
                                        completion_window="24h")
    done = await until_more(client, batch.id, 3)

    pipeline.workers[0].kill()  # six lines die with it, mid-generation
    pipeline.workers[0].start()
    done = await until_more(client, batch.id, done)
    assert done < LINES, "the batch finished before the dispatcher could be killed"

    pipeline.dispatcher.kill()  # and the batch runner with it
    pipeline.dispatcher.start()
    deadline = time.monotonic() + 90
    while (status := (await completed(client, batch.id))[0]) not in (
            "completed", "failed", "expired", "cancelled"):
        assert time.monotonic() < deadline, status
        await asyncio.sleep(0.2)
    final = await client.batches.retrieve(batch.id)
    assert final.status == "completed", final
    assert final.request_counts is not None
    assert final.request_counts.completed == LINES
    assert final.request_counts.failed == 0
    assert final.error_file_id is None
    assert final.output_file_id is not None
    content = (await client.files.content(final.output_file_id)).content
    output = [json.loads(line) for line in content.splitlines()]
    counts = Counter(o["custom_id"] for o in output)
    assert counts == Counter(line["custom_id"] for line in lines)  # each exactly once
    assert all(o["response"]["status_code"] == 200 for o in output)


def test_clean_stop_hands_the_lead_over_at_once(tmp_path_factory: pytest.TempPathFactory,
                                                module_nats_url: str,
                                                module_redis_url: str) -> None:
    """SIGTERM to the leading dispatcher resigns its lease: a standby leads well
    before the lease (30 s here) would have expired."""
    pipeline = Pipeline(tmp_path_factory.mktemp("batchlead"), module_nats_url,
                        module_redis_url, workers=0,
                        overrides={"batch": {"lease": 30.0},
                                   "nats": {"subject_prefix": "lead"}})
    pipeline.dispatchers.append(pipeline._process("dispatcher", "dispatcher1"))
    try:
        pipeline.start()

        def leader() -> ManagedProcess | None:
            for p in pipeline.dispatchers:
                if "leads (epoch" in p.log_path.read_text(errors="replace"):
                    return p
            return None

        deadline = time.monotonic() + 60
        while (first := leader()) is None:
            assert time.monotonic() < deadline, pipeline.logs()
            time.sleep(0.1)
        standby = next(p for p in pipeline.dispatchers if p is not first)
        first.stop()
        assert "resigned the lead" in first.log_path.read_text(errors="replace")
        stopped = time.monotonic()
        while "leads (epoch 2)" not in standby.log_path.read_text(errors="replace"):
            assert time.monotonic() - stopped < 10, standby.log_tail(30)
            time.sleep(0.1)
    finally:
        pipeline.stop()


async def test_a_line_whose_worker_dies_restarts_on_another_at_once(
        tmp_path_factory: pytest.TempPathFactory, module_nats_url: str,
        module_redis_url: str) -> None:
    """Worker 0 SIGKILLed (and not restarted) while it runs batch lines: the
    runner's liveness probe finds it gone and hands each of its jobs back
    (``-NAK``), so worker 1 restarts them at once. ``worker.ack_wait`` and the
    silence limit are 120 s here, the other two ways a line comes back: the
    batch completing well before them is the probe's doing."""
    models = [{"name": "tidegate-sim", "max_streams": 4,
               "simulator": {"ttft": 0.05, "tokens_per_second": 10.0, "length": 20}}]
    pipeline = Pipeline(tmp_path_factory.mktemp("batchdeath"), module_nats_url,
                        module_redis_url, workers=2, overrides={
                            "nats": {"subject_prefix": "bd"},
                            "models": models,
                            "session": {"heartbeat_interval": 1.0, "worker_lost_after": 130},
                            "worker": {"ack_wait": 120.0}})
    pipeline.start()
    try:
        async with openai.AsyncOpenAI(base_url=pipeline.base_url, api_key=DEV_KEY,
                                      max_retries=2, timeout=30) as client:
            lines = 16
            data = b"".join(json.dumps({
                "custom_id": f"d-{i}", "method": "POST", "url": "/v1/chat/completions",
                "body": {"model": "tidegate-sim", "max_tokens": 20,
                         "messages": [{"role": "user", "content": f"line {i}"}]}}).encode()
                + b"\n" for i in range(lines))
            file = await client.files.create(file=("in.jsonl", io.BytesIO(data)),
                                             purpose="batch")
            batch = await client.batches.create(input_file_id=file.id,
                                                endpoint="/v1/chat/completions",
                                                completion_window="24h")
            # Released into the 8 free slots at once, the first 8 lines run
            # 2 s each, 4 on each worker: worker 0 dies mid-generation.
            await until_more(client, batch.id, -1)  # in progress
            await asyncio.sleep(1.0)
            assert (await completed(client, batch.id))[1] == 0, "a line ended before the kill"
            pipeline.workers[0].kill()
            killed = time.monotonic()
            while (await completed(client, batch.id))[0] not in (
                    "completed", "failed", "expired", "cancelled"):
                assert time.monotonic() - killed < 110, "the lines waited for ack_wait"
                await asyncio.sleep(0.2)
            final = await client.batches.retrieve(batch.id)
    finally:
        pipeline.stop()
    assert final.status == "completed", final
    assert final.request_counts is not None
    assert (final.request_counts.completed, final.request_counts.failed) == (lines, 0)
    assert "job handed back" in pipeline.dispatcher.log_path.read_text()
