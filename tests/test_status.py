"""``tidegate status`` against a running pipeline: JSON, the rendered view,
the worker registry, and queue mode read from Redis."""

from __future__ import annotations

import asyncio
import io
import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import redis.asyncio as aioredis

from dispatcher.queueing import QueueMode
from fleet.run import status
from tests.pipeline import Pipeline, running_pipeline

pytestmark = pytest.mark.pipeline

MODEL = "tidegate-sim"


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory: pytest.TempPathFactory, module_nats_url: str,
             module_redis_url: str) -> Iterator[Pipeline]:
    yield from running_pipeline(tmp_path_factory.mktemp("status"), module_nats_url,
                                module_redis_url,
                                overrides={"nats": {"subject_prefix": "tgs"}})


def status_json(pipeline: Pipeline) -> dict[str, Any]:
    out = io.StringIO()
    assert status.run(pipeline.config, as_json=True, interval=0.3, out=out) == 0
    return dict(json.loads(out.getvalue()))


def test_json_rates_count_the_requests_between_two_samples(pipeline: Pipeline) -> None:
    """Requests sent while ``tidegate status`` takes its two samples show as
    a rate above zero (requests, jobs started and finished)."""
    stop = threading.Event()
    sent: list[int] = []

    def load() -> None:
        while not stop.is_set():
            status_code, _ = pipeline.post("/v1/chat/completions", {
                "model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "r"}]})
            sent.append(status_code)

    thread = threading.Thread(target=load, daemon=True)
    thread.start()
    try:
        out = io.StringIO()
        assert status.run(pipeline.config, as_json=True, interval=1.5, out=out) == 0
        doc = json.loads(out.getvalue())
    finally:
        stop.set()
        thread.join(30)
    assert sent
    assert set(sent) == {200}
    assert doc["requests_per_s"] > 0, doc
    (model,) = doc["models"]
    assert model["rates"]["started_per_s"] > 0, model
    assert model["rates"]["finished_per_s"] > 0, model


def test_json_shows_models_workers_and_queues(pipeline: Pipeline) -> None:
    for i in range(3):
        status_code, _ = pipeline.post("/v1/chat/completions", {
            "model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": f"{i}"}]})
        assert status_code == 200
    doc = status_json(pipeline)
    (model,) = doc["models"]
    assert model["model"] == MODEL
    assert model["workers"] == 1
    max_streams = pipeline.config.models[0].max_streams
    assert model["slots"] == {"total": max_streams, "used": 0, "free": max_streams}
    assert model["queue"] == {"depth": 0, "waiting": 0, "running": 0, "oldest_age_s": 0}
    assert model["queue_mode"] == {"mode": "normal", "limit": 0, "p99_ms": 0.0, "queued": 0,
                                   "queued_by_class": {"interactive": 0, "background": 0,
                                                       "batch": 0}}
    assert set(model["rates"]) == {"started_per_s", "finished_per_s"}
    assert doc["requests_per_s"] == 0.0  # nothing arrived between the two samples
    # (finished_per_s is left out: a usage record may land just after the
    # first sample, though its request was answered before.)
    assert model["rates"]["started_per_s"] == 0.0
    assert doc["dispatch_backlog"] == 0
    (worker,) = doc["workers"]
    assert worker["models"] == {MODEL: {"slots": max_streams, "in_flight": 0}}
    assert worker["heartbeat_age_s"] < 10
    assert not worker["draining"]


def test_queue_mode_from_redis(pipeline: Pipeline) -> None:
    async def set_mode(mode: str) -> None:
        client = aioredis.Redis.from_url(pipeline.config.redis.url, decode_responses=True)
        try:
            queue = QueueMode(client, pipeline.config.nats.subject_prefix)
            key = queue.state_key(MODEL)
            await client.hset(key, mapping={"mode": mode, "limit": 7, "p99_ms": 812.5})
            # Held requests, as the queue's scripts count them per class.
            base = queue.queue_key(MODEL)
            await client.mset({f"{base}:n": 5 if mode == "queue" else 0,
                               f"{base}:n:0": 3 if mode == "queue" else 0,
                               f"{base}:n:1": 2 if mode == "queue" else 0})
        finally:
            await client.aclose()

    asyncio.run(set_mode("queue"))
    try:
        doc = status_json(pipeline)
        assert doc["models"][0]["queue_mode"] == {
            "mode": "queue", "limit": 7, "p99_ms": 812.5, "queued": 5,
            "queued_by_class": {"interactive": 3, "background": 2, "batch": 0}}
        out = io.StringIO()
        assert status.run(pipeline.config, once=True, interval=0.1, out=out) == 0
        view = out.getvalue()
        assert "Models" in view
        assert "Workers" in view
        assert MODEL in view
        assert "queue" in view
        assert "812 ms" in view
        assert "5 (i3 bg2)" in view  # held, by class
    finally:
        asyncio.run(set_mode("normal"))


def test_cli_json(pipeline: Pipeline) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "fleet", "status", "--json", "--interval", "0.2",
         "--config", str(pipeline.config_path)],
        capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    assert doc["models"][0]["model"] == MODEL


def test_cli_without_nats_fails_cleanly() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "fleet", "status", "--json",
         "--nats-url", "nats://127.0.0.1:1"],
        capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert "Traceback" not in done.stderr
    assert "NATS" in done.stderr or "nats" in done.stderr
