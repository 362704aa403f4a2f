"""Preemption with the shipped defaults (workers/preemption.py): an interactive
request that finds the model's only slot held by a background response takes
it; the background response is handed back and continued from its log, its
text byte-exact against an uninterrupted run of its input (the simulator's
deterministic mode). Real nats-server, redis-server, edge, dispatcher, worker.

Without preemption the interactive stream waits for the background response
to finish (3 s), which has then completed before it.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest

from tests.pipeline import DEV_KEY, Pipeline, running_pipeline, stream
from tests.poll import eventually
from tests.test_spare_capacity import spare_slots

pytestmark = [pytest.mark.pipeline, pytest.mark.timeout(240)]

MODEL = "tidegate-sim"
LENGTH = 150  # tokens at 50 a second: a background answer holds the slot 3 s
HEADERS = {"Authorization": f"Bearer {DEV_KEY}"}


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory: pytest.TempPathFactory, module_nats_url: str,
             module_redis_url: str) -> Iterator[Pipeline]:
    models = [{"name": MODEL, "max_streams": 1,
               "simulator": {"ttft": 0.02, "tokens_per_second": 50.0, "length": LENGTH,
                             "deterministic": True}}]
    yield from running_pipeline(tmp_path_factory.mktemp("preempt"), module_nats_url,
                                module_redis_url, metrics=True,
                                overrides={"models": models,
                                           "nats": {"subject_prefix": "p" + uuid.uuid4().hex[:6]}})


async def _create(session: aiohttp.ClientSession, p: Pipeline, text: str) -> str:
    async with session.post(f"{p.url}/v1/responses", headers=HEADERS, json={
            "model": MODEL, "input": text, "background": True}) as resp:
        assert resp.status == 200, await resp.text()
        return str((await resp.json())["id"])


async def _get(session: aiohttp.ClientSession, p: Pipeline, rid: str) -> dict[str, Any]:
    async with session.get(f"{p.url}/v1/responses/{rid}", headers=HEADERS) as resp:
        assert resp.status == 200, await resp.text()
        body: dict[str, Any] = await resp.json()
        return body


async def _final(session: aiohttp.ClientSession, p: Pipeline, rid: str) -> dict[str, Any]:
    async def ended() -> dict[str, Any] | None:
        body = await _get(session, p, rid)
        return body if body["status"] not in ("queued", "in_progress") else None
    return await eventually(ended, 120, f"response {rid} ended", step=0.2)


async def test_an_interactive_stream_takes_a_background_responses_slot_losing_nothing(
        pipeline: Pipeline) -> None:
    text = f"preempted-{uuid.uuid4().hex}"
    async with aiohttp.ClientSession() as session:
        rid = await _create(session, pipeline, text)

        async def generating() -> bool:
            return (await _get(session, pipeline, rid))["status"] == "in_progress"

        await eventually(generating, 60, "the background response generating")
        await eventually(lambda: spare_slots(pipeline) == 0, 60, "the gate seeing the slot taken")
        raw, _ = await stream(session, pipeline.url, MODEL, "interactive", max_tokens=5)
        assert raw.endswith(b"data: [DONE]\n\n")
        # It ran before the background response ended: in its slot.
        assert (await _get(session, pipeline, rid))["status"] == "in_progress"
        answer = await _final(session, pipeline, rid)
        whole = await _final(session, pipeline, await _create(session, pipeline, text))
    assert "preempted after" in pipeline.logs()
    assert answer["status"] == "completed", answer
    got = answer["output"][0]["content"][0]["text"]
    assert got == whole["output"][0]["content"][0]["text"]
    assert answer["usage"]["output_tokens"] == LENGTH, answer["usage"]
