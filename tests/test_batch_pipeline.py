"""The Files + Batches API through the whole pipeline, driven by the official openai SDK.

Real nats-server and redis-server, edge / dispatcher / worker as processes: a
batch's lines really cross the requests and jobs streams as class ``batch``
requests, and its files really live in the JetStream Object Store.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import nats
import openai
import pytest

from bench.fake_backend import FakeBackend
from tests.pipeline import DEV_KEY, Pipeline, record_for, running_pipeline, threaded_fake_backend
from tidegate.control.keys import create_key, ensure_keys_bucket
from tidegate.control.policies import BATCH_SCOPE, Policy, ensure_policies_bucket, set_policy

pytestmark = pytest.mark.pipeline

MAX_FILE = 1 << 20
RETRIES = 2


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeBackend]:
    with threaded_fake_backend(models=["fake-model"], ttft=0.01, itl=0.002,
                               tokens=8) as backend:
        yield backend


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory: pytest.TempPathFactory, module_nats_url: str,
             module_redis_url: str, fake: FakeBackend) -> Iterator[Pipeline]:
    models: list[dict[str, Any]] = [
        {"name": "fake", "backend": "openai", "base_url": fake.base_url,
         "upstream_model": "fake-model"},
        {"name": "tidegate-sim", "aliases": ["sim"],
         "simulator": {"ttft": 0.01, "tokens_per_second": 400.0, "length": 32}},
        # Slow enough that a batch is still running when the test cancels or expires it.
        {"name": "slow-sim", "max_streams": 4,
         "simulator": {"ttft": 0.05, "tokens_per_second": 20.0, "length": 40}},
    ]
    yield from running_pipeline(
        tmp_path_factory.mktemp("batch"), module_nats_url, module_redis_url,
        overrides={"models": models, "batch": {"max_file_bytes": MAX_FILE, "lease": 1.0,
                                                "max_retries": RETRIES}})


@pytest.fixture
async def client(pipeline: Pipeline) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url=pipeline.base_url, api_key=DEV_KEY,
                                  max_retries=0, timeout=30) as c:
        yield c


def jsonl(lines: list[dict[str, Any]]) -> bytes:
    return b"".join(json.dumps(line).encode() + b"\n" for line in lines)


def chat_line(custom_id: str, content: str, model: str = "tidegate-sim",
              max_tokens: int = 6) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": model, "max_tokens": max_tokens,
                     "messages": [{"role": "user", "content": content}]}}


async def submit(client: openai.AsyncOpenAI, lines: list[dict[str, Any]] | bytes,
                 window: str = "24h") -> Any:
    data = lines if isinstance(lines, bytes) else jsonl(lines)
    file = await client.files.create(file=("input.jsonl", io.BytesIO(data)), purpose="batch")
    return await client.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions",
                                       completion_window=window)  # type: ignore[arg-type]


async def poll(client: openai.AsyncOpenAI, batch_id: str, done: set[str],
               within: float = 60.0) -> Any:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        batch = await client.batches.retrieve(batch_id)
        if batch.status in done:
            return batch
        await asyncio.sleep(0.2)
    raise AssertionError(f"batch {batch_id} still {batch.status} after {within}s")


async def lines_of(client: openai.AsyncOpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    content = await client.files.content(file_id)
    return [json.loads(line) for line in content.content.splitlines() if line.strip()]


async def test_batch_end_to_end_matches_interactive(client: openai.AsyncOpenAI) -> None:
    prompts = {f"req-{i}": f"Tell me about item {i}" for i in range(12)}
    batch = await submit(client, [chat_line(cid, text) for cid, text in prompts.items()])
    assert batch.status == "validating"
    assert batch.id.startswith("batch_")
    assert len(batch.id) >= len("batch_") + 24
    done = await poll(client, batch.id, {"completed", "failed", "expired"})
    assert done.status == "completed", done
    assert done.request_counts.total == 12
    assert done.request_counts.completed == 12
    assert done.request_counts.failed == 0
    assert done.error_file_id is None
    for stamp in ("in_progress_at", "finalizing_at", "completed_at"):
        assert getattr(done, stamp) is not None, stamp
    output = await lines_of(client, done.output_file_id)
    assert sorted(o["custom_id"] for o in output) == sorted(prompts)
    for out in output:
        assert out["error"] is None
        assert out["response"]["status_code"] == 200
        interactive = await client.chat.completions.create(
            model="tidegate-sim", max_tokens=6,
            messages=[{"role": "user", "content": prompts[out["custom_id"]]}])
        body = out["response"]["body"]
        assert body["choices"][0]["message"]["content"] == \
            interactive.choices[0].message.content
        assert body["usage"]["completion_tokens"] == interactive.usage.completion_tokens  # type: ignore[union-attr]
    listed = await client.batches.list(limit=100)
    assert done.id in [b.id for b in listed.data]
    output_file = await client.files.retrieve(done.output_file_id)  # type: ignore[arg-type]
    assert output_file.purpose == "batch_output"


async def test_validation_names_the_line(client: openai.AsyncOpenAI) -> None:
    lines = [jsonl([chat_line(f"v-{i}", "hi")]) for i in range(10)]
    lines[6] = b'{"custom_id": "v-6", "method": "POST", this is not json\n'
    batch = await submit(client, b"".join(lines))
    failed = await poll(client, batch.id, {"failed", "completed"})
    assert failed.status == "failed"
    assert failed.errors is not None
    errors = failed.errors.data or []
    assert [(e.code, e.line) for e in errors] == [("invalid_json_line", 7)]
    assert failed.failed_at is not None

    dup = [chat_line("same", "a"), chat_line("other", "b"), chat_line("same", "c")]
    wrong = chat_line("w", "x")
    wrong["url"] = "/v1/embeddings"
    batch = await submit(client, [*dup, wrong])
    failed = await poll(client, batch.id, {"failed", "completed"})
    assert failed.status == "failed"
    got = {(e.code, e.line) for e in failed.errors.data or []}  # type: ignore[union-attr]
    assert got == {("duplicate_custom_id", 3), ("invalid_url", 4)}


async def test_oversize_file_is_refused(client: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.APIStatusError) as err:
        await client.files.create(file=("big.jsonl", io.BytesIO(b"x" * (MAX_FILE + 1))),
                                  purpose="batch")
    assert err.value.status_code == 413
    assert err.value.body["code"] == "file_too_large"  # type: ignore[index]


async def test_files_api(client: openai.AsyncOpenAI) -> None:
    data = jsonl([chat_line("f-1", "hello")])
    file = await client.files.create(file=("mine.jsonl", io.BytesIO(data)), purpose="batch")
    assert file.object == "file"
    assert file.bytes == len(data)
    assert file.filename == "mine.jsonl"
    assert file.id.startswith("file-")
    assert len(file.id) >= len("file-") + 24
    assert (await client.files.retrieve(file.id)).bytes == len(data)
    assert file.id in [f.id for f in (await client.files.list()).data]
    assert (await client.files.content(file.id)).content == data
    deleted = await client.files.delete(file.id)
    assert deleted.deleted
    with pytest.raises(openai.NotFoundError):
        await client.files.retrieve(file.id)
    with pytest.raises(openai.BadRequestError):
        await client.files.create(file=("x.jsonl", io.BytesIO(data)),
                                  purpose="fine-tune")


async def test_tenant_isolation(pipeline: Pipeline, client: openai.AsyncOpenAI,
                                module_nats_url: str) -> None:
    nc = await nats.connect(module_nats_url)
    try:
        other_key, _ = await create_key(await ensure_keys_bucket(nc.jetstream(),
                                                                 pipeline.config), "other")
    finally:
        await nc.close()
    file = await client.files.create(file=("a.jsonl", io.BytesIO(jsonl([chat_line("t", "x")]))),
                                     purpose="batch")
    batch = await client.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions",
                                        completion_window="24h")
    async with openai.AsyncOpenAI(base_url=pipeline.base_url, api_key=other_key,
                                  max_retries=0, timeout=30) as other:
        deadline = time.monotonic() + 10
        while True:  # the new key reaches the edge through its KV watch
            try:
                await other.files.list()
                break
            except openai.AuthenticationError:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.1)
        for call in (other.files.retrieve(file.id), other.files.content(file.id),
                     other.files.delete(file.id), other.batches.retrieve(batch.id),
                     other.batches.cancel(batch.id),
                     other.batches.create(input_file_id=file.id,
                                          endpoint="/v1/chat/completions",
                                          completion_window="24h")):
            with pytest.raises(openai.NotFoundError):
                await call
        assert file.id not in [f.id for f in (await other.files.list()).data]
        assert batch.id not in [b.id for b in (await other.batches.list()).data]
    # ... and the owner still has both.
    assert (await client.files.retrieve(file.id)).id == file.id
    await poll(client, batch.id, {"completed"})


async def test_cancel_mid_batch_keeps_partial_results(client: openai.AsyncOpenAI) -> None:
    # 4 slots, ~2 s per line: 16 lines need ~8 s, the cancel comes after the first results.
    lines = [chat_line(f"c-{i}", f"slow {i}", model="slow-sim", max_tokens=40)
             for i in range(16)]
    batch = await submit(client, lines)
    deadline = time.monotonic() + 30
    while (b := await client.batches.retrieve(batch.id)).request_counts is None or \
            b.request_counts.completed < 1:
        assert time.monotonic() < deadline, b
        await asyncio.sleep(0.1)
    cancelling = await client.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled")
    done = await poll(client, batch.id, {"cancelled", "completed"})
    assert done.status == "cancelled"
    assert done.cancelled_at is not None
    assert done.cancelling_at is not None
    assert 1 <= done.request_counts.completed < 16  # type: ignore[union-attr]
    output = await lines_of(client, done.output_file_id)
    assert len(output) == done.request_counts.completed  # type: ignore[union-attr]
    assert len({o["custom_id"] for o in output}) == len(output)
    with pytest.raises(openai.ConflictError):
        await client.batches.cancel((await poll(client, (await submit(
            client, [chat_line("quick", "q")])).id, {"completed"})).id)


async def test_expiry_with_a_short_window(client: openai.AsyncOpenAI) -> None:
    # Two lines that take a tenth of a second, then fourteen of ~100 s: the
    # window ends while those run, however slow a busy machine is (sixteen
    # 2 s lines in a 4 s window saw none finish on a loaded box).
    lines = [chat_line(f"e-{i}", f"slow {i}", model="slow-sim",
                       max_tokens=1 if i < 2 else 2000) for i in range(16)]
    batch = await submit(client, lines, window="10s")
    done = await poll(client, batch.id, {"expired", "completed", "failed"}, within=120)
    assert done.status == "expired"
    assert done.expired_at is not None
    counts = done.request_counts
    assert counts is not None
    assert counts.total == 16
    assert counts.completed == 2
    output = await lines_of(client, done.output_file_id)
    errors = await lines_of(client, done.error_file_id)
    assert len(output) == counts.completed
    assert {e["error"]["code"] for e in errors} == {"batch_expired"}
    assert sorted(o["custom_id"] for o in output + errors) == sorted(
        line["custom_id"] for line in lines)


def cli(pipeline: Pipeline, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIDEGATE_")}
    return subprocess.run([sys.executable, "-m", "fleet", *args, "--config",
                           str(pipeline.config_path)], capture_output=True, text=True,
                          timeout=60, env=env)


async def test_operator_cli_lists_shows_and_cancels(pipeline: Pipeline,
                                                    client: openai.AsyncOpenAI) -> None:
    # Lines of ~100 s each: the batch is still in progress after the CLI's
    # start-ups, however slow a busy machine makes them (2 s lines used to
    # finish first); the cancel ends the running ones upstream at once.
    lines = [chat_line(f"o-{i}", f"slow {i}", model="slow-sim", max_tokens=2000)
             for i in range(12)]
    batch = await submit(client, lines)
    await poll(client, batch.id, {"in_progress"})
    status = await asyncio.to_thread(cli, pipeline, "status", "--json", "--interval", "0.2")
    assert status.returncode == 0, status.stderr
    assert batch.id in [b["id"] for b in json.loads(status.stdout)["batches"]]
    listed = await asyncio.to_thread(cli, pipeline, "batches", "list", "--json",
                                     "--status", "in_progress")
    assert listed.returncode == 0, listed.stderr
    rows = {r["id"]: r for r in json.loads(listed.stdout)}
    assert rows[batch.id]["tenant"] == "default"
    assert rows[batch.id]["total"] == 12
    cancelled = await asyncio.to_thread(cli, pipeline, "batches", "cancel", batch.id)
    assert cancelled.returncode == 0, cancelled.stderr
    done = await poll(client, batch.id, {"cancelled"})
    shown = await asyncio.to_thread(cli, pipeline, "batches", "show", batch.id)
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["status"] == "cancelled"
    assert done.request_counts is not None
    assert done.request_counts.completed < 12
    again = await asyncio.to_thread(cli, pipeline, "batches", "show", "batch_nope")
    assert again.returncode == 2
    assert "not a batch id" in again.stderr


async def test_4xx_to_the_error_file_5xx_retried_first(client: openai.AsyncOpenAI,
                                                      fake: FakeBackend) -> None:
    ok = chat_line("ok", "fine marker-ok", model="fake")
    bad = chat_line("bad", "refused marker-400", model="fake")
    bad["body"]["fake_status"] = 400
    down = chat_line("down", "broken marker-503", model="fake")
    down["body"]["fake_status"] = 503
    batch = await submit(client, [ok, bad, down])
    done = await poll(client, batch.id, {"completed", "failed", "expired"})
    assert done.status == "completed"
    assert done.request_counts is not None
    assert (done.request_counts.completed, done.request_counts.failed) == (1, 2)
    output = await lines_of(client, done.output_file_id)
    assert [o["custom_id"] for o in output] == ["ok"]
    errors = {e["custom_id"]: e for e in await lines_of(client, done.error_file_id)}
    assert set(errors) == {"bad", "down"}
    assert errors["bad"]["response"]["status_code"] == 400
    assert errors["bad"]["response"]["body"]["error"]["type"] == "invalid_request_error"
    assert errors["down"]["response"] is None
    assert errors["down"]["error"]["code"]
    # The 4xx ran once; the 5xx once and then RETRIES more times.
    assert len(record_for(fake, "marker-400")) == 1
    assert len(record_for(fake, "marker-503")) == 1 + RETRIES
    assert len(record_for(fake, "marker-ok")) == 1


async def test_batch_only_limits(pipeline: Pipeline, module_nats_url: str) -> None:
    """A policy on model @batch limits the tenant's batch lines only: with
    concurrency 1 its four 2-second lines run one after the other, while the
    same tenant's interactive requests are not limited by it."""
    nc = await nats.connect(module_nats_url)
    try:
        js = nc.jetstream()
        key, _ = await create_key(await ensure_keys_bucket(js, pipeline.config), "limited")
        await set_policy(await ensure_policies_bucket(js, pipeline.config),
                         Policy(tenant="limited", model=BATCH_SCOPE, concurrency=1))
    finally:
        await nc.close()
    async with openai.AsyncOpenAI(base_url=pipeline.base_url, api_key=key, max_retries=0,
                                  timeout=30) as limited:
        deadline = time.monotonic() + 10
        while True:  # the new key reaches the edge through its KV watch
            try:
                await limited.files.list()
                break
            except openai.AuthenticationError:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.1)
        lines = [chat_line(f"l-{i}", f"limited {i}", model="slow-sim", max_tokens=40)
                 for i in range(4)]
        batch = await submit(limited, lines)
        await poll(limited, batch.id, {"in_progress"})
        # Interactive traffic of the same tenant: two at once, both admitted.
        answers = await asyncio.gather(*(limited.chat.completions.create(
            model="tidegate-sim", max_tokens=2, messages=[{"role": "user", "content": "hi"}])
            for _ in range(2)))
        assert all(a.choices[0].message.content for a in answers)
        started = time.monotonic()
        done = await poll(limited, batch.id, {"completed", "failed", "expired"}, within=60)
        took = time.monotonic() - started
    assert done.status == "completed"
    assert done.request_counts is not None
    assert done.request_counts.completed == 4
    # One at a time: about 4 x 2 s (4 slots would have run them in ~2 s at once).
    assert done.completed_at is not None
    assert done.in_progress_at is not None
    print(f"4 lines under batch concurrency 1: {done.completed_at - done.in_progress_at}s "
          f"({took:.1f}s polled)")
    assert done.completed_at - done.in_progress_at >= 6
