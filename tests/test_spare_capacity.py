"""Lower classes on spare capacity, with the shipped queue settings (no queue
mode): a background response that finds the model's slots full waits in the
dispatcher's fair queue, so an interactive request sent after it runs first
(dispatcher/gate.py). Real nats-server, redis-server, dispatcher and worker.

Without the gate, the background jobs sit ahead of the interactive one in
TG_JOBS and all three have completed by the time it ends.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from dispatcher.queueing import QueueMode
from dispatcher.quota import connect
from tests.pipeline import DEV_KEY, Pipeline, paced_simulator, running_pipeline, stream
from tests.poll import eventually

pytestmark = [pytest.mark.pipeline, pytest.mark.timeout(240)]

MODEL = "tidegate-sim"
FINISHED = ("completed", "incomplete")  # incomplete: cut at max_output_tokens, as asked


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory: pytest.TempPathFactory, module_nats_url: str,
             module_redis_url: str) -> Iterator[Pipeline]:
    workdir: Path = tmp_path_factory.mktemp("spare")
    # One slot, 20 tokens a second: a 200-token answer holds it for 10 s.
    models = paced_simulator(1, 20.0)
    models[0]["simulator"]["length"] = 200
    yield from running_pipeline(workdir, module_nats_url, module_redis_url,
                                metrics=True, overrides={"models": models,
                                           "nats": {"subject_prefix": "s" + uuid.uuid4().hex[:6]}})


@pytest.fixture
async def held(pipeline: Pipeline) -> AsyncIterator[QueueMode]:
    client = connect(pipeline.config.redis.url, 2.0)
    yield QueueMode(client, pipeline.config.nats.subject_prefix)
    await client.aclose()


async def test_background_work_waits_for_a_free_slot_behind_interactive_work(
        pipeline: Pipeline, held: QueueMode) -> None:
    client = openai.AsyncOpenAI(base_url=f"{pipeline.url}/v1", api_key=DEV_KEY, max_retries=0,
                                timeout=60)
    progress: dict[str, int] = {}
    async with aiohttp.ClientSession() as session:
        # An interactive stream takes the only slot for about 10 s.
        first = asyncio.create_task(stream(session, pipeline.url, MODEL, "long one",
                                           progress=progress))
        await eventually(lambda: progress.get("long one", 0) >= 3, 60, "the first stream")
        await eventually(lambda: spare_slots(pipeline) == 0, 60, "the gate seeing the slot taken")
        background = [await client.responses.create(model=MODEL, input=f"later {i}",
                                                    background=True, max_output_tokens=5)
                      for i in range(3)]
        await eventually(lambda: _held(held), 30, "the background responses held")
        # Sent after them, run before them.
        raw, _ = await stream(session, pipeline.url, MODEL, "short one", max_tokens=5)
        assert raw.endswith(b"data: [DONE]\n\n")
        statuses = [(await client.responses.retrieve(r.id)).status for r in background]
        assert not set(statuses) & set(FINISHED), statuses
        await first
    # ... and none is lost: each runs to its 5 tokens once the slot is free.
    for r in background:
        done = await eventually(lambda r=r: _finished(client, r.id), 90, f"{r.id} finished")
        assert done.output_text
        assert done.incomplete_details is not None
        assert done.incomplete_details.reason == "max_output_tokens"
    await client.close()


async def _held(queue: QueueMode) -> bool:
    return (await queue.queued_by_class(MODEL))["background"] == 3


async def _finished(client: openai.AsyncOpenAI,
                    rid: str) -> openai.types.responses.Response | None:
    response = await client.responses.retrieve(rid)
    assert response.status in ("queued", "in_progress", *FINISHED), response.status
    return response if response.status in FINISHED else None


def spare_slots(pipeline: Pipeline) -> float | None:
    """The dispatcher's ``tidegate_slots_spare`` for the model (None: not set yet)."""
    for family in text_string_to_metric_families(pipeline.scrape("dispatcher")):
        for sample in family.samples:
            if (sample.name == "tidegate_slots_spare"
                    and sample.labels.get("gen_ai_request_model") == MODEL):
                return sample.value
    return None
