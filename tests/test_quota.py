"""dispatcher.quota against a real redis-server (the suite's fixtures, free ports).

Most tests drive a fake clock through ``now=`` and share one module server,
each under its own key prefix. The fault test kills and restarts a server of
its own; the accuracy test runs three processes, each with its own connection.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import random
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
import redis.asyncio as aioredis
from redis.asyncio.connection import Connection
from redis.crc import key_slot

from dispatcher.quota import Limits, QuotaResult, QuotaStore, QuotaUnavailable, Scope, connect
from tests.servers import ServerHandle

T0 = 1_700_000_000.0  # fake clock origin


@pytest.fixture
async def client(module_redis_server: ServerHandle) -> AsyncIterator[aioredis.Redis]:
    c = connect(module_redis_server.url, timeout=2.0)
    try:
        yield c
    finally:
        await c.aclose()


@pytest.fixture
def store(client: aioredis.Redis) -> QuotaStore:
    return QuotaStore(client, prefix=f"t{uuid.uuid4().hex[:8]}", window=60.0, lease=1800.0)


def tpm(limit: int, name: str = "s") -> Scope:
    return Scope(name, Limits(tpm=limit))


async def total(store: QuotaStore, scope_id: str) -> int:
    _, _, t, _ = store.scope_keys(scope_id)
    return int(await store.redis.get(t) or 0)


async def entries(store: QuotaStore, scope_id: str) -> int:
    w, _, _, _ = store.scope_keys(scope_id)
    return int(await store.redis.zcard(w))


async def slots(store: QuotaStore, scope_id: str) -> int:
    _, _, _, c = store.scope_keys(scope_id)
    return int(await store.redis.zcard(c))


# -- one limit at a time -------------------------------------------------------------


async def test_requests_limit(store: QuotaStore) -> None:
    scope = Scope("tenant.acme", Limits(rpm=3))
    for i in range(3):
        assert (await store.reserve(f"r{i}", [scope], 10, now=T0 + i)).admitted
    refused = await store.reserve("r3", [scope], 10, now=T0 + 10)
    assert not refused.admitted
    assert (refused.limit, refused.scope, refused.too_large) == ("requests", "tenant.acme", False)
    assert refused.retry_after == pytest.approx(50.0)  # r0 (at T0) leaves at T0 + 60
    assert await entries(store, "tenant.acme") == 3  # the refusal charged nothing


async def test_tokens_limit(store: QuotaStore) -> None:
    scope = tpm(1000)
    assert (await store.reserve("a", [scope], 400, now=T0)).admitted
    assert (await store.reserve("b", [scope], 400, now=T0 + 20)).admitted
    refused = await store.reserve("c", [scope], 300, now=T0 + 30)
    assert (refused.admitted, refused.limit, refused.scope) == (False, "tokens", "s")
    assert refused.retry_after == pytest.approx(30.0)  # "a" frees enough at T0 + 60
    big = await store.reserve("d", [scope], 700, now=T0 + 30)
    assert big.retry_after == pytest.approx(50.0)  # needs "a" and "b" gone
    assert (await store.reserve("e", [scope], 200, now=T0 + 30)).admitted  # still fits
    assert await total(store, "s") == 1000


async def test_concurrency_limit(store: QuotaStore) -> None:
    scope = Scope("s", Limits(concurrency=2))
    assert (await store.reserve("a", [scope], 10, now=T0)).admitted
    assert (await store.reserve("b", [scope], 10, now=T0)).admitted
    refused = await store.reserve("c", [scope], 10, now=T0)
    assert (refused.admitted, refused.limit, refused.retry_after) == (False, "concurrency", 1.0)
    await store.reconcile("a", 5, now=T0 + 1)
    assert (await store.reserve("c", [scope], 10, now=T0 + 1)).admitted
    await store.release("b")
    assert await slots(store, "s") == 1


async def test_unlimited_scopes_write_nothing(store: QuotaStore) -> None:
    result = await store.reserve("a", [Scope("s", Limits())], 10**9, now=T0)
    assert result == QuotaResult(admitted=True)
    assert await store.redis.keys(f"{store.key_prefix}*") == []


# -- several scopes ------------------------------------------------------------------


async def test_all_or_nothing_across_scopes(store: QuotaStore) -> None:
    tenant = Scope("tenant", Limits(rpm=100, tpm=1000, concurrency=10))
    model = Scope("model", Limits(tpm=500))
    assert (await store.reserve("other", [model], 400, now=T0)).admitted
    refused = await store.reserve("r", [tenant, model], 200, now=T0 + 1)
    assert (refused.admitted, refused.limit, refused.scope) == (False, "tokens", "model")
    # the tenant scope had room, yet nothing was charged to it
    assert (await entries(store, "tenant"), await total(store, "tenant")) == (0, 0)
    assert await slots(store, "tenant") == 0
    assert not await store.redis.exists(store.record_key("r"))

    ok = await store.reserve("r", [tenant, model], 100, now=T0 + 2)
    assert ok.admitted
    assert (await total(store, "tenant"), await total(store, "model")) == (100, 500)
    assert await slots(store, "tenant") == 1


async def test_refusal_reports_the_limit_that_frees_last(store: QuotaStore) -> None:
    a = Scope("a", Limits(tpm=100))
    b = Scope("b", Limits(rpm=1))
    assert (await store.reserve("x", [a], 100, now=T0)).admitted  # a frees at T0 + 60
    assert (await store.reserve("y", [b], 1, now=T0 + 30)).admitted  # b frees at T0 + 90
    refused = await store.reserve("z", [a, b], 1, now=T0 + 31)
    assert (refused.limit, refused.scope) == ("requests", "b")
    assert refused.retry_after == pytest.approx(59.0)


async def test_duplicate_scope_ids_are_rejected(store: QuotaStore) -> None:
    with pytest.raises(ValueError, match="duplicate"):
        await store.reserve("a", [tpm(10), tpm(20)], 1, now=T0)


async def test_all_keys_share_one_cluster_slot(store: QuotaStore) -> None:
    scopes = [Scope(f"tenant.t{i}.model.m{i % 3}", Limits(rpm=5, tpm=500, concurrency=5))
              for i in range(5)]
    for i in range(3):
        await store.reserve(f"req-{i}", scopes, 10, now=T0)
    mine = await store.redis.keys(f"{store.key_prefix}*")
    assert len(mine) == 5 * 4 + 3
    assert len({key_slot(str(k).encode()) for k in mine}) == 1


# -- the window slides ---------------------------------------------------------------


async def test_window_slides_with_the_clock(store: QuotaStore) -> None:
    scope = Scope("s", Limits(rpm=10, tpm=1000))
    assert (await store.reserve("a", [scope], 600, now=T0)).admitted
    assert (await store.reserve("b", [scope], 400, now=T0 + 30)).admitted
    late = await store.reserve("c", [scope], 1, now=T0 + 59.9)
    assert not late.admitted
    assert late.retry_after == pytest.approx(0.1, abs=1e-6)
    # an entry counts during [t, t + window): at T0 + 60 "a" is out
    assert (await store.reserve("c", [scope], 600, now=T0 + 60)).admitted
    assert await total(store, "s") == 1000
    assert await entries(store, "s") == 2
    assert not (await store.reserve("d", [scope], 1, now=T0 + 89)).admitted
    assert (await store.reserve("d", [scope], 400, now=T0 + 90)).admitted


async def test_worked_example_from_the_docs(store: QuotaStore) -> None:
    """The table in docs/quotas.md, "Requests and tokens per minute"."""
    scope = tpm(1000)
    assert (await store.reserve("A", [scope], 600, now=T0)).admitted
    assert (await store.reserve("B", [scope], 400, now=T0 + 30)).admitted
    refused = await store.reserve("C", [scope], 100, now=T0 + 40)
    assert (refused.admitted, refused.retry_after) == (False, pytest.approx(20.0))
    await store.reconcile("B", 150, now=T0 + 45)
    assert await total(store, "s") == 750
    assert (await store.reserve("C", [scope], 100, now=T0 + 46)).remaining_tokens == 150
    assert (await store.reserve("D", [scope], 1, now=T0 + 60)).remaining_tokens == 1000 - 251


def test_prefix_must_keep_the_hash_tag_intact(client: aioredis.Redis) -> None:
    with pytest.raises(ValueError, match="braces"):
        QuotaStore(client, prefix="t{x}")


async def test_large_windows_page_and_evict_in_chunks(client: aioredis.Redis) -> None:
    """Past the script's page (64) and eviction chunk (1000) sizes."""
    store = QuotaStore(client, prefix=f"t{uuid.uuid4().hex[:8]}", window=10_000.0)
    scope = Scope("s", Limits(tpm=25_000))
    for i in range(2500):
        assert (await store.reserve(f"r{i}", [scope], 10, now=T0 + i)).admitted
    refused = await store.reserve("big", [scope], 1000, now=T0 + 2500)
    # 1000 tokens free once the 100 oldest (the last at T0 + 99) have left
    assert refused.retry_after == pytest.approx(99 + 10_000 - 2500)
    ok = await store.reserve("next", [scope], 10, now=T0 + 10_000 + 1999.5)
    assert ok.remaining_tokens == 25_000 - 5000 - 10  # r0..r1999 evicted
    assert await entries(store, "s") == 501


# -- reconcile and release -----------------------------------------------------------


async def test_reconcile_down_frees_tokens(store: QuotaStore) -> None:
    scope = tpm(1000)
    assert (await store.reserve("a", [scope], 800, now=T0)).admitted
    assert not (await store.reserve("b", [scope], 800, now=T0 + 1)).admitted
    await store.reconcile("a", 150, now=T0 + 2)
    assert await total(store, "s") == 150
    assert (await store.reserve("b", [scope], 800, now=T0 + 3)).admitted


async def test_reconcile_up_charges_the_overshoot(store: QuotaStore) -> None:
    scope = tpm(1000)
    assert (await store.reserve("a", [scope], 100, now=T0)).admitted
    await store.reconcile("a", 950, now=T0 + 5)
    assert await total(store, "s") == 950
    refused = await store.reserve("b", [scope], 100, now=T0 + 6)
    assert not refused.admitted
    assert refused.retry_after == pytest.approx(54.0)  # when "a" (950 tokens) leaves


async def test_reconcile_applies_to_every_charged_scope(store: QuotaStore) -> None:
    scopes = [Scope("tenant", Limits(tpm=10_000, concurrency=5)), Scope("user", Limits(rpm=9)),
              Scope("model", Limits(tpm=50_000))]
    assert (await store.reserve("a", scopes, 1000, now=T0)).admitted
    await store.reconcile("a", 37, now=T0 + 1)
    assert (await total(store, "tenant"), await total(store, "model")) == (37, 37)
    assert await entries(store, "user") == 1  # the request still counts for rpm
    assert await slots(store, "tenant") == 0


async def test_reconcile_after_the_window_leaves_totals_alone(store: QuotaStore) -> None:
    scope = tpm(1000)
    assert (await store.reserve("long", [scope], 500, now=T0)).admitted
    assert (await store.reserve("new", [scope], 100, now=T0 + 61)).admitted  # evicts "long"
    await store.reconcile("long", 900, now=T0 + 90)
    assert await total(store, "s") == 100


async def test_reconcile_and_release_are_idempotent(store: QuotaStore) -> None:
    scope = Scope("s", Limits(tpm=1000, concurrency=3))
    assert (await store.reserve("a", [scope], 500, now=T0)).admitted
    assert (await store.reserve("b", [scope], 100, now=T0)).admitted
    await store.reconcile("a", 200, now=T0 + 1)
    await store.reconcile("a", 200, now=T0 + 1)
    await store.reconcile("a", 999, now=T0 + 2)  # a different late duplicate: still ignored
    assert await total(store, "s") == 300
    await store.release("a")  # after reconcile: nothing left to release
    assert await slots(store, "s") == 1

    await store.release("b")
    await store.release("b")
    assert await slots(store, "s") == 0
    await store.reconcile("b", 40, now=T0 + 3)  # usage reported after the slot was released
    assert await total(store, "s") == 240

    await store.reconcile("never-reserved", 10)
    await store.release("never-reserved")


async def test_reserving_the_same_request_twice_charges_once(store: QuotaStore) -> None:
    scope = Scope("s", Limits(rpm=1, tpm=100, concurrency=1))
    assert (await store.reserve("a", [scope], 100, now=T0)).admitted
    again = await store.reserve("a", [scope], 100, now=T0 + 1)  # e.g. a redelivery
    assert again.admitted
    assert (await total(store, "s"), await entries(store, "s"), await slots(store, "s")) == \
        (100, 1, 1)


# -- leases --------------------------------------------------------------------------


async def test_concurrency_lease_expires(client: aioredis.Redis) -> None:
    store = QuotaStore(client, prefix=f"t{uuid.uuid4().hex[:8]}", window=60.0, lease=10.0)
    scope = Scope("s", Limits(concurrency=1))
    assert (await store.reserve("dead-dispatchers-request", [scope], 1, now=T0)).admitted
    assert not (await store.reserve("b", [scope], 1, now=T0 + 9.9)).admitted
    assert (await store.reserve("b", [scope], 1, now=T0 + 10.0)).admitted  # lease over
    # the late reconcile of the expired request does not free b's slot
    await store.reconcile("dead-dispatchers-request", 1, now=T0 + 11)
    assert not (await store.reserve("c", [scope], 1, now=T0 + 11)).admitted


# -- too large, headers --------------------------------------------------------------


async def test_too_large_can_never_pass(store: QuotaStore) -> None:
    scopes = [Scope("small", Limits(tpm=100)), Scope("busy", Limits(rpm=1))]
    assert (await store.reserve("x", [scopes[1]], 1, now=T0)).admitted
    result = await store.reserve("a", scopes, 101, now=T0 + 1)
    assert (result.admitted, result.too_large, result.limit, result.scope) == \
        (False, True, "tokens", "small")
    assert result.retry_after == 0.0
    assert await entries(store, "small") == 0
    exactly = await store.reserve("b", [scopes[0]], 100, now=T0 + 1)
    assert (exactly.admitted, exactly.too_large) == (True, False)


async def test_header_values_name_the_most_constraining_scope(store: QuotaStore) -> None:
    tenant = Scope("tenant", Limits(rpm=10, tpm=2000))
    user = Scope("user", Limits(rpm=5, tpm=5000))
    first = await store.reserve("a", [tenant, user], 300, now=T0)
    assert (first.limit_requests, first.remaining_requests) == (5, 4)  # user: 4 of 5 left
    assert (first.limit_tokens, first.remaining_tokens) == (2000, 1700)  # tenant
    assert first.reset_requests == pytest.approx(60.0)
    assert first.reset_tokens == pytest.approx(60.0)

    # the tenant scope alone gets busier; the user scope stays the tighter on requests
    for i in range(4):
        assert (await store.reserve(f"t{i}", [tenant], 100, now=T0 + 1 + i)).admitted
    later = await store.reserve("b", [tenant, user], 100, now=T0 + 10)
    assert (later.limit_requests, later.remaining_requests) == (5, 3)
    assert (later.limit_tokens, later.remaining_tokens) == (2000, 1200)
    assert later.reset_tokens == pytest.approx(60.0)

    refused = await store.reserve("c", [tenant], 1500, now=T0 + 20)
    assert not refused.admitted
    assert (refused.limit_tokens, refused.remaining_tokens) == (2000, 1200)
    assert refused.reset_tokens == pytest.approx(50.0)  # "b" (newest, T0 + 10) leaves at +70
    assert (refused.limit_requests, refused.remaining_requests) == (10, 4)

    only_concurrency = await store.reserve("d", [Scope("c", Limits(concurrency=3))], 1)
    assert (only_concurrency.limit_requests, only_concurrency.limit_tokens) == (0, 0)


# -- round trips ---------------------------------------------------------------------


class CountingConnection(Connection):
    """Counts what the client sends: one packed write per command round trip."""

    sent: list[str] = []

    async def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        CountingConnection.sent.append(repr(command)[:40])
        await super().send_packed_command(command, check_health)


async def commandstats(client: aioredis.Redis) -> dict[str, int]:
    info = await client.info("commandstats")
    return {name.removeprefix("cmdstat_"): int(v["calls"]) for name, v in info.items()}


async def test_one_round_trip_per_reserve(module_redis_server: ServerHandle,
                                          client: aioredis.Redis) -> None:
    counted = aioredis.Redis.from_url(module_redis_server.url, decode_responses=True,
                                      connection_class=CountingConnection)
    try:
        store = QuotaStore(counted, prefix=f"t{uuid.uuid4().hex[:8]}")
        scopes = [Scope("tenant", Limits(rpm=50, tpm=10_000, concurrency=40)),
                  Scope("model", Limits(tpm=100_000)), Scope("user", Limits(rpm=30))]
        await store.reserve("warm-up", scopes, 1)  # connects, loads the script
        CountingConnection.sent.clear()
        before = await commandstats(client)
        results = [await store.reserve(f"r{i}", scopes, 200) for i in range(100)]
        after = await commandstats(client)
        assert {r.admitted for r in results} == {True, False}
        assert len(CountingConnection.sent) == 100
        assert after["evalsha"] - before["evalsha"] == 100
        assert after.get("eval", 0) == before.get("eval", 0)
        assert after.get("script", 0) == before.get("script", 0)
    finally:
        await counted.aclose()


# -- Redis outage --------------------------------------------------------------------


async def test_unavailable_then_recovers_without_a_new_store(redis_server: ServerHandle) -> None:
    client = connect(redis_server.url, timeout=1.0)
    try:
        store = QuotaStore(client, prefix="tg")
        scope = Scope("s", Limits(tpm=1000, concurrency=5))
        assert (await store.reserve("a", [scope], 100)).admitted

        redis_server.kill()
        started = time.monotonic()
        with pytest.raises(QuotaUnavailable):
            await store.reserve("b", [scope], 100)
        with pytest.raises(QuotaUnavailable):
            await store.reconcile("a", 50)
        with pytest.raises(QuotaUnavailable):
            await store.release("a")
        assert time.monotonic() - started < 5.0  # refused connections fail fast

        # a fresh, empty server (no persistence): the script is reloaded on NOSCRIPT
        redis_server.restart()
        result = await store.reserve("b", [scope], 100)
        assert (result.admitted, result.remaining_tokens) == (True, 900)
        await store.reconcile("b", 10)
        assert (await store.reserve("c", [scope], 990)).admitted
    finally:
        await client.aclose()


# -- accuracy across processes -------------------------------------------------------

LIMIT = 20_000
MAX_COST = 150


def _burst(url: str, prefix: str, worker: int, ready: Any, start: Any, out: Any) -> None:
    """One 'dispatcher': its own process, event loop and connection."""

    async def run() -> None:
        client = connect(url, timeout=5.0)
        store = QuotaStore(client, prefix=prefix)
        scope = Scope("tenant.acme", Limits(tpm=LIMIT))
        rng = random.Random(worker)
        costs = [rng.randint(50, MAX_COST) for _ in range(200)]
        await store.reserve(f"warm-{worker}", [Scope("other", Limits(rpm=1))], 1)
        ready.put(worker)  # connected, script loaded: the burst may start
        sem = asyncio.Semaphore(16)

        async def one(i: int, cost: int) -> int:
            async with sem:
                result = await store.reserve(f"w{worker}-{i}", [scope], cost)
                return cost if result.admitted else 0

        start.wait()
        admitted = await asyncio.gather(*(one(i, c) for i, c in enumerate(costs)))
        await client.aclose()
        out.put((worker, sum(admitted), sum(1 for a in admitted if a), len(costs)))

    asyncio.run(run())


def test_three_processes_stay_within_the_limit(module_redis_server: ServerHandle) -> None:
    ctx = multiprocessing.get_context("spawn")
    ready, start, out = ctx.Queue(), ctx.Event(), ctx.Queue()
    prefix = f"t{uuid.uuid4().hex[:8]}"
    procs = [ctx.Process(target=_burst,
                         args=(module_redis_server.url, prefix, w, ready, start, out))
             for w in range(3)]
    for p in procs:
        p.start()

    async def stats() -> dict[str, int]:
        c = connect(module_redis_server.url, timeout=2.0)
        try:
            return await commandstats(c)
        finally:
            await c.aclose()

    try:
        # Every child connected and warmed up before the burst and the snapshot.
        assert sorted(ready.get(timeout=60) for _ in procs) == [0, 1, 2]
        before = asyncio.run(stats())
        start.set()
        results = [out.get(timeout=60) for _ in procs]
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    after = asyncio.run(stats())

    admitted = sum(r[1] for r in results)
    requests = sum(r[3] for r in results)
    assert all(r[3] == 200 for r in results), results
    assert admitted <= LIMIT  # exact: never above the limit at all
    assert admitted >= 0.98 * LIMIT, (admitted, results)
    # one EVALSHA per reserve, from every process (the warm-ups came before the snapshot)
    assert after["evalsha"] - before["evalsha"] == requests

    async def stored_total() -> int:
        c = connect(module_redis_server.url, timeout=2.0)
        try:
            return await total(QuotaStore(c, prefix=prefix), "tenant.acme")
        finally:
            await c.aclose()

    assert asyncio.run(stored_total()) == admitted
