"""What docs/batch.md promises and no other test proved, against real servers
(issue 26): a line's result is created once and never overwritten (the first
attempt to finish is the one in the output, also when the line ran twice),
and cancelling a batch that is finalizing or ended is a 409
``batch_not_cancellable``. Each was seen failing with the promise broken.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import aiohttp
import nats
import pytest

from dispatcher.batch import files as bf
from tests.pipeline import DEV_KEY, Pipeline, running_pipeline
from tests.poll import eventually
from tidegate import config as tgconfig
from tidegate.control.batches import Stores, open_stores

pytestmark = pytest.mark.pipeline

AUTH = {"Authorization": f"Bearer {DEV_KEY}"}


@pytest.fixture
async def stores(module_nats_url: str) -> AsyncIterator[Stores]:
    config = tgconfig.from_dict({
        "nats": {"url": module_nats_url, "subject_prefix": "b" + uuid.uuid4().hex[:8]},
        "models": [{"name": "tidegate-sim", "simulator": {"ttft": 0.0}}]})
    nc = await nats.connect(module_nats_url)
    try:
        yield await open_stores(nc.jetstream(), config)
    finally:
        await nc.close()


async def test_a_lines_result_is_created_once_and_never_overwritten(stores: Stores) -> None:
    batch_id = "batch_" + uuid.uuid4().hex
    first = bf.OK + b'{"custom_id": "a", "attempt": 1}'
    # The same line finished again (its runner died and a successor ran it):
    # the later attempt, a failure this time, must not replace the first.
    assert await bf.record_result(stores, batch_id, 0, first) is True
    assert await bf.record_result(stores, batch_id, 0,
                                  bf.FAILED + b'{"custom_id": "a", "attempt": 2}') is True
    assert (await stores.results.get(bf.key(batch_id, 0))).value == first
    # And the other way round: a failure first stays the failure.
    failed = bf.FAILED + b'{"custom_id": "b", "attempt": 1}'
    assert await bf.record_result(stores, batch_id, 1, failed) is False
    assert await bf.record_result(stores, batch_id, 1, bf.OK + b'{"attempt": 2}') is False
    assert (await stores.results.get(bf.key(batch_id, 1))).value == failed
    assert await bf.load_results(stores, batch_id) == {0: True, 1: False}


# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory: pytest.TempPathFactory, module_nats_url: str,
             module_redis_url: str) -> Iterator[Pipeline]:
    models = [{"name": "tidegate-sim", "simulator": {"ttft": 0.01, "tokens_per_second": 400.0,
                                                     "length": 8}},
              {"name": "slow-sim", "max_streams": 2,
               "simulator": {"ttft": 0.05, "tokens_per_second": 20.0, "length": 40}}]
    yield from running_pipeline(tmp_path_factory.mktemp("batch"), module_nats_url,
                                module_redis_url, overrides={"models": models})


async def create_batch(session: aiohttp.ClientSession, pipeline: Pipeline,
                       lines: list[dict[str, Any]]) -> str:
    data = b"".join(json.dumps(line).encode() + b"\n" for line in lines)
    form = aiohttp.FormData()
    form.add_field("purpose", "batch")
    form.add_field("file", data, filename="in.jsonl")
    async with session.post(f"{pipeline.base_url}/files", data=form, headers=AUTH) as resp:
        assert resp.status == 200, await resp.text()
        file_id = (await resp.json())["id"]
    async with session.post(f"{pipeline.base_url}/batches", headers=AUTH, json={
            "input_file_id": file_id, "endpoint": "/v1/chat/completions",
            "completion_window": "24h"}) as resp:
        assert resp.status == 200, await resp.text()
        return str((await resp.json())["id"])


def line(i: int, model: str) -> dict[str, Any]:
    return {"custom_id": f"l-{i}", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": model, "max_tokens": 40,
                     "messages": [{"role": "user", "content": f"line {i}"}]}}


async def status(session: aiohttp.ClientSession, pipeline: Pipeline, batch_id: str) -> str:
    async with session.get(f"{pipeline.base_url}/batches/{batch_id}", headers=AUTH) as resp:
        return str((await resp.json())["status"])


async def cancel(session: aiohttp.ClientSession, pipeline: Pipeline,
                 batch_id: str) -> tuple[int, Any]:
    async with session.post(f"{pipeline.base_url}/batches/{batch_id}/cancel",
                            headers=AUTH) as resp:
        return resp.status, await resp.json()


async def test_cancelling_an_ended_batch_is_409_batch_not_cancellable(
        pipeline: Pipeline) -> None:
    async with aiohttp.ClientSession() as session:
        done = await create_batch(session, pipeline, [line(0, "tidegate-sim")])
        running = await create_batch(session, pipeline,
                                     [line(i, "slow-sim") for i in range(8)])
        await eventually(lambda: _is(session, pipeline, done, "completed"), 120,
                         "the one-line batch completed", step=0.1)
        code, body = await cancel(session, pipeline, done)
        assert code == 409, body
        assert body["error"]["code"] == "batch_not_cancellable"
        assert body["error"]["type"] == "invalid_request_error"
        assert await status(session, pipeline, done) == "completed"  # unchanged

        code, body = await cancel(session, pipeline, running)  # cancellable: 200
        assert code == 200, body
        assert body["status"] in ("cancelling", "cancelled")
        await eventually(lambda: _is(session, pipeline, running, "cancelled"), 120,
                         "the running batch ended cancelled", step=0.1)
        # Cancelling twice is the same cancel (tidegate.wire.batch.cancel), not a 409.
        code, body = await cancel(session, pipeline, running)
        assert code == 200, body
        assert body["status"] == "cancelled"


async def _is(session: aiohttp.ClientSession, pipeline: Pipeline, batch_id: str,
              wanted: str) -> bool:
    return await status(session, pipeline, batch_id) == wanted
