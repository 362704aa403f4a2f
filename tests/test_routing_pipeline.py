"""Routing across two backend replicas of one model, through the whole pipeline
(real nats-server, redis-server, tiers as processes, two fake backends).

Which replica served a request is read off the fakes' own records, so nothing
here trusts tidegate's account of where it sent a job.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import nats
import nats.js.errors
import pytest

from bench.fake_backend import FakeBackend, FakeConfig
from tests.pipeline import Pipeline, running_pipeline, threaded_fake_backend
from tidegate.control.workers_registry import WorkerInfo

pytestmark = pytest.mark.pipeline

MODEL = "chat-model"


@pytest.fixture(scope="module")
def replicas() -> Iterator[tuple[FakeBackend, FakeBackend]]:
    with threaded_fake_backend(ttft=0.01, itl=0.001, tokens=4) as a, \
            threaded_fake_backend(ttft=0.01, itl=0.001, tokens=4) as b:
        yield a, b


def start(workdir: Path, nats_url: str, redis_url: str, fakes: tuple[FakeBackend, ...],
          affinity: str = "auto", max_streams: int = 8) -> Iterator[Pipeline]:
    # The fallback after max_affinity_wait is right behaviour, but a loaded CI
    # machine can take a second to claim a job: 3 s keeps these tests about
    # routing, and the killed-home test sets its own bound.
    models: list[dict[str, Any]] = [{
        "name": MODEL, "backend": "openai", "base_urls": [f.base_url for f in fakes],
        "max_streams": max_streams}]
    yield from running_pipeline(workdir, nats_url, redis_url, overrides={
        "models": models, "routing": {"affinity": affinity, "max_affinity_wait": 3.0}})


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory: pytest.TempPathFactory, module_nats_url: str,
             module_redis_url: str, replicas: tuple[FakeBackend, FakeBackend]
             ) -> Iterator[Pipeline]:
    yield from start(tmp_path_factory.mktemp("routing"), module_nats_url, module_redis_url,
                     replicas, max_streams=2)


async def registry_names_replicas(nats_url: str, count: int, within: float = 20.0) -> None:
    """Until the workers registry reports ``count`` replicas of MODEL: the
    dispatcher routes by what it reports."""
    nc = await nats.connect(nats_url)
    try:
        kv = await nc.jetstream().key_value("TG_WORKERS")
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            try:
                keys = await kv.keys()
            except Exception:
                keys = []
            for key in keys:
                info = WorkerInfo.decode((await kv.get(key)).value or b"{}")
                if len(info.replicas.get(MODEL, {})) == count:
                    return
            await asyncio.sleep(0.2)
        raise AssertionError(f"no worker reported {count} replicas of {MODEL}")
    finally:
        await nc.close()


def served_by(fakes: tuple[FakeBackend, ...], marker: str) -> list[int]:
    """Indexes of the fakes that got a request containing ``marker``."""
    return [i for i, fake in enumerate(fakes) for r in list(fake.records)
            if marker in json.dumps(r.body)]


def chat_turns(marker: str, turns: int, **extra: Any) -> list[dict[str, Any]]:
    out, history = [], [{"role": "system", "content": f"You help {marker}."}]
    for i in range(turns):
        history = [*history, {"role": "user", "content": f"turn {i} of {marker}"}]
        out.append({"model": MODEL, "messages": history, "max_tokens": 2, **extra})
        history = [*history, {"role": "assistant", "content": f"answer {i}"}]
    return out


def converse(pipeline: Pipeline, fakes: tuple[FakeBackend, ...], marker: str, turns: int = 4,
             **extra: Any) -> list[int]:
    """Run one chat's turns in order; the replica that served each."""
    where = []
    for i, body in enumerate(chat_turns(marker, turns, **extra)):
        status, payload = pipeline.post("/v1/chat/completions", body)
        assert status == 200, payload
        hits = served_by(fakes, f"turn {i} of {marker}")
        assert len(hits) == 1, f"turn {i} of {marker} reached {hits}"
        where.append(hits[0])
    return where


@pytest.fixture
def routed(pipeline: Pipeline, module_nats_url: str) -> Pipeline:
    asyncio.run(registry_names_replicas(module_nats_url, 2))
    return pipeline


def test_turns_of_a_chat_reach_the_replica_of_turn_one(
        routed: Pipeline, replicas: tuple[FakeBackend, FakeBackend]) -> None:
    placements = [converse(routed, replicas, f"chat-{uuid.uuid4().hex[:8]}") for _ in range(8)]
    for where in placements:
        assert len(set(where)) == 1, placements
    # New chats spread over both replicas (rendezvous over equal headroom).
    assert {where[0] for where in placements} == {0, 1}, placements


def test_prompt_cache_key_overrides_the_derived_key(
        routed: Pipeline, replicas: tuple[FakeBackend, FakeBackend]) -> None:
    key = f"conv-{uuid.uuid4().hex[:8]}"
    first = converse(routed, replicas, f"a-{uuid.uuid4().hex[:8]}", turns=1,
                     prompt_cache_key=key)
    # Different conversations (different prefixes) under one cache key.
    others = [converse(routed, replicas, f"b-{uuid.uuid4().hex[:8]}", turns=1,
                       prompt_cache_key=key)[0] for _ in range(5)]
    assert set(others) == {first[0]}


@pytest.fixture
def unrouted(tmp_path: Path, nats_server: Any, redis_server: Any,
             replicas: tuple[FakeBackend, FakeBackend]) -> Iterator[Pipeline]:
    for pipeline in start(tmp_path, nats_server.url, redis_server.url, replicas,
                          affinity="off"):
        asyncio.run(registry_names_replicas(nats_server.url, 2))
        yield pipeline


def test_with_affinity_off_turns_spread(
        unrouted: Pipeline, replicas: tuple[FakeBackend, FakeBackend]) -> None:
    placements = [converse(unrouted, replicas, f"off-{uuid.uuid4().hex[:8]}", turns=4)
                  for _ in range(6)]
    # 24 turns on a shared queue pulled by two replicas' slots: at least one
    # chat crosses replicas (all six staying put by chance: < 0.5^18).
    assert any(len(set(where)) > 1 for where in placements), placements


@pytest.fixture
def per_replica(tmp_path: Path, nats_server: Any, redis_server: Any,
                replicas: tuple[FakeBackend, FakeBackend]) -> Iterator[Pipeline]:
    """One worker process per replica (worker.replicas), as a fleet runs them."""
    names = [f.base_url.split("://", 1)[1] for f in replicas]
    pipeline = Pipeline(tmp_path, nats_server.url, redis_server.url, workers=2,
                        worker_env=[{"TIDEGATE__WORKER__REPLICAS": n} for n in names],
                        overrides={"models": [{"name": MODEL, "backend": "openai",
                                               "base_urls": [f.base_url for f in replicas]}],
                                   "routing": {"max_affinity_wait": 0.5}})
    try:
        pipeline.start()
        asyncio.run(registry_names_replicas(nats_server.url, 1))
        yield pipeline
    finally:
        pipeline.stop()


def test_a_killed_home_costs_at_most_the_affinity_wait(
        per_replica: Pipeline, replicas: tuple[FakeBackend, FakeBackend]) -> None:
    """kill -9 the home replica's worker: the next turn, routed there by a load
    view that still shows it alive, is copied to the shared queue after
    max_affinity_wait and the other replica answers; nothing is lost."""
    key = f"dead-{uuid.uuid4().hex[:8]}"
    # Both workers must have reported before the home is chosen.
    for _ in range(50):
        warm = converse(per_replica, replicas, f"w-{uuid.uuid4().hex[:8]}", turns=1)
        if len({*warm, *served_by(replicas, "turn 0 of w-")}) == 2:
            break
    home = converse(per_replica, replicas, f"k-{uuid.uuid4().hex[:8]}", turns=1,
                    prompt_cache_key=key)[0]
    per_replica.workers[home].kill()
    started = time.monotonic()
    where = converse(per_replica, replicas, f"k2-{uuid.uuid4().hex[:8]}", turns=1,
                     prompt_cache_key=key)[0]
    took = time.monotonic() - started
    assert where != home
    # The wait bound (0.5 s) plus a request's round trip on a loaded machine;
    # without the fallback the job would wait for a worker that never comes.
    assert took < 5.0, took


def replica_rows(pipeline: Pipeline) -> dict[str, dict[str, Any]]:
    done = subprocess.run(
        [sys.executable, "-m", "fleet", "status", "--json", "--interval", "0.2",
         "--config", str(pipeline.config_path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    model = next(m for m in json.loads(done.stdout)["models"] if m["model"] == MODEL)
    return {r["replica"]: r for r in model["replicas"]}


def totals(rows: dict[str, dict[str, Any]]) -> tuple[int, int]:
    return sum(r["jobs"] for r in rows.values()), sum(r["hits"] for r in rows.values())


def test_status_shows_each_replica_with_its_hit_rate(
        routed: Pipeline, replicas: tuple[FakeBackend, FakeBackend]) -> None:
    # The registry is a heartbeat (5 s) behind: a baseline that held over one
    # heartbeat already counts the earlier tests' jobs.
    before = replica_rows(routed)
    while True:
        time.sleep(5.5)
        again = replica_rows(routed)
        if totals(again) == totals(before):
            break
        before = again
    # New chats land by rendezvous hashing of their random keys: chat on
    # until each replica is the home of one (three chats all land on one
    # replica a quarter of the time).
    homes: list[int] = []
    while len(set(homes)) < 2:
        assert len(homes) < 24, f"24 new chats, all on replica {homes[0]}"
        homes.append(converse(routed, replicas, f"s-{uuid.uuid4().hex[:8]}", turns=3)[0])
    names = {f.base_url.split("://", 1)[1] for f in replicas}
    want = 3 * len(homes)
    deadline = time.monotonic() + 20
    while True:
        rows = replica_rows(routed)
        jobs = totals(rows)[0] - totals(before)[0]
        if jobs >= want or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert set(rows) == names
    assert all(r["slots"] == 2 for r in rows.values())
    assert jobs == want, rows
    # Turns 2 and 3 of each chat were home hits, turn 1 never.
    assert totals(rows)[1] - totals(before)[1] == 2 * len(homes), rows
    for r in rows.values():
        assert r["jobs"] > 0, rows
        assert r["hit_rate"] == round(r["hits"] / r["jobs"], 3), rows


def test_backend_reported_load_steers_new_conversations(
        tmp_path: Path, nats_server: Any, redis_server: Any) -> None:
    """vLLM-style /metrics: a replica reporting waiting requests takes no new
    conversation; one reporting a nearly full KV cache takes few."""
    with threaded_fake_backend(config=FakeConfig(ttft=0.01, itl=0.001, tokens=4,
                                                 report_load=True)) as a, \
            threaded_fake_backend(config=FakeConfig(ttft=0.01, itl=0.001, tokens=4,
                                                    report_load=True)) as b:
        fakes = (a, b)
        a.waiting = 4
        for pipeline in start(tmp_path, nats_server.url, redis_server.url, fakes):
            asyncio.run(registry_names_replicas(nats_server.url, 2))
            # The probe polls every second; the registry beats every 5 s.
            name_a = a.base_url.split("://", 1)[1]
            deadline = time.monotonic() + 60  # a positive event; the limit is only a backstop
            while not _reported(nats_server.url, name_a, waiting=4) \
                    and time.monotonic() < deadline:
                time.sleep(0.3)
            assert _reported(nats_server.url, name_a, waiting=4)
            first = [converse(pipeline, fakes, f"q-{uuid.uuid4().hex[:8]}", turns=1)[0]
                     for _ in range(10)]
            assert first == [1] * 10, first
            a.waiting, a.kv_usage = 0, 0.95
            deadline = time.monotonic() + 60
            while not _reported(nats_server.url, name_a, waiting=0, kv_usage=0.95) \
                    and time.monotonic() < deadline:
                time.sleep(0.3)
            assert _reported(nats_server.url, name_a, waiting=0, kv_usage=0.95)
            later = [converse(pipeline, fakes, f"r-{uuid.uuid4().hex[:8]}", turns=1)[0]
                     for _ in range(20)]
            # Weight 0.05 against 1: about one in twenty; 5 of 20 is far out.
            assert later.count(0) <= 5, later
            assert later.count(1) >= 15, later


def _reported(nats_url: str, replica: str, **expected: Any) -> bool:
    """Whether the registry shows ``replica`` with these backend-reported
    values (the dispatcher gets them sooner, in load messages)."""
    async def read() -> bool:
        nc = await nats.connect(nats_url)
        try:
            kv = await nc.jetstream().key_value("TG_WORKERS")
            try:
                keys = await kv.keys()
            except nats.js.errors.NoKeysError:
                return False  # no worker has beaten yet (a busy machine starts them late)
            for key in keys:
                info = WorkerInfo.decode((await kv.get(key)).value or b"{}")
                slot = info.replicas.get(MODEL, {}).get(replica)
                if slot is not None and all(getattr(slot, k) == v for k, v in expected.items()):
                    return True
            return False
        finally:
            await nc.close()
    return asyncio.run(read())
