"""Queue mode's shares against a real redis-server (dispatcher/queueing.py):
tenants of one class share a saturated model by tokens and by their tier's
weight, a tenant that comes back owes for what it was just granted, a full
queue makes room for a better class, and each class waits its own TTL.

Each test fails on the round robin by requests that came before (one turn per
tenant whatever its requests cost), or without the rule it names.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

import nats
import pytest

from dispatcher.gate import QueueGate
from dispatcher.queueing import QueueMode
from dispatcher.quota import connect
from tests.poll import eventually
from tidegate.config import Config, ModelConfig, QueueModeConfig, TierConfig
from tidegate.control import operations
from tidegate.control.admin import UsageError
from tidegate.control.tenants import (
    TenantSettings,
    TenantTable,
    ensure_tenants_bucket,
    set_tenant,
    watch_tenants,
)
from tidegate.wire.classes import BACKGROUND, BATCH, INTERACTIVE
from tidegate.wire.protocol import Api, Request

CFG = QueueModeConfig(ttft_p99=0.2, ttl=10.0, background_ttl=100.0, batch_ttl=200.0,
                      max_queued=6)
ROOMY = QueueModeConfig(ttft_p99=0.2, ttl=10.0)


@pytest.fixture
async def queue(redis_server: Any) -> AsyncIterator[QueueMode]:
    client = connect(redis_server.url, 2.0)
    yield QueueMode(client, "f" + uuid.uuid4().hex[:8])  # a store of its own per test
    await client.aclose()


async def _granted_one_by_one(queue: QueueMode, now: float) -> list[str]:
    order = []
    while grants := await queue.grant("m", 1, now):
        order += [g.request_id for g in grants if g.granted]
    return order


async def test_tenants_of_one_class_share_by_tokens_not_by_requests(queue: QueueMode) -> None:
    """A tenant of 1,000-token requests and one of 100-token requests: the
    short one's six go before the long one's second (by requests they would
    alternate)."""
    now = 1000.0
    for i in range(6):
        await queue.enqueue("m", f"long{i}", "a-long", INTERACTIVE, "d1", now + i, ROOMY,
                            cost=1000)
        await queue.enqueue("m", f"short{i}", "b-short", INTERACTIVE, "d1", now + i, ROOMY,
                            cost=100)
    order = await _granted_one_by_one(queue, now + 6)
    assert order == ["long0", *(f"short{i}" for i in range(6)),
                     *(f"long{i}" for i in range(1, 6))]


async def test_a_tier_of_weight_four_gets_four_turns_to_one(queue: QueueMode) -> None:
    """Equal requests, one tenant in a tier of weight 4 (its cost a quarter,
    as the gate computes it): four of its grants to each of the other's."""
    now = 2000.0
    for i in range(5):
        await queue.enqueue("m", f"gold{i}", "gold", INTERACTIVE, "d1", now + i, ROOMY,
                            cost=100 / 4)
        await queue.enqueue("m", f"free{i}", "free", INTERACTIVE, "d1", now + i, ROOMY,
                            cost=100)
    order = await _granted_one_by_one(queue, now + 6)
    # free goes first (a tie, by name), then gold four times, then free again
    assert order[:7] == ["free0", "gold0", "gold1", "gold2", "gold3", "free1", "gold4"]


async def test_a_tenant_that_comes_back_at_once_still_owes_for_its_last_grant(
        queue: QueueMode) -> None:
    """a is granted a 1,000-token request and its queue empties; it asks again
    beside b, new, of 100-token requests: b's go first (had a's debt been
    forgotten, a and b would start even)."""
    now = 3000.0
    await queue.enqueue("m", "a0", "a", INTERACTIVE, "d1", now, ROOMY, cost=1000)
    assert [g.request_id for g in await queue.grant("m", 1, now)] == ["a0"]
    await queue.enqueue("m", "a1", "a", INTERACTIVE, "d1", now + 1, ROOMY, cost=100)
    for i in range(3):
        await queue.enqueue("m", f"b{i}", "b", INTERACTIVE, "d1", now + 1, ROOMY, cost=100)
    assert await _granted_one_by_one(queue, now + 2) == ["b0", "b1", "b2", "a1"]


async def test_a_full_queue_makes_room_for_a_better_class_and_tells_whom_it_displaced(
        queue: QueueMode) -> None:
    now = 4000.0
    for i in range(6):
        state, _ = await queue.enqueue("m", f"batch{i}", f"t{i % 2}", BATCH, "d1", now + i, CFG)
        assert state == "queued"
    assert await queue.enqueue("m", "chat", "t9", INTERACTIVE, "d1", now + 7, CFG) == (
        "queued", 1)
    # the newest batch line gave up its place; its owner learns it from positions
    assert (await queue.positions("m", ["batch5", "batch4"]))[0] == -3
    assert await queue.queued("m") == 6
    assert await queue.queued_by_class("m") == {INTERACTIVE: 1, BACKGROUND: 0, BATCH: 5}
    # a request never displaces its own class or a better one
    for i in range(5):
        await queue.enqueue("m", f"chat{i}", "t9", INTERACTIVE, "d1", now + 8, CFG)
    assert (await queue.enqueue("m", "late", "t8", INTERACTIVE, "d1", now + 9, CFG))[0] == "full"
    assert await queue.queued_by_class("m") == {INTERACTIVE: 6, BACKGROUND: 0, BATCH: 0}
    assert (await queue.enqueue("m", "bg", "t8", BACKGROUND, "d1", now + 9, CFG))[0] == "full"


async def test_each_class_waits_its_own_ttl(queue: QueueMode) -> None:
    now = 5000.0
    await queue.enqueue("m", "chat", "t", INTERACTIVE, "d1", now, CFG)
    await queue.enqueue("m", "bg", "t", BACKGROUND, "d1", now, CFG)
    await queue.enqueue("m", "line", "t", BATCH, "d1", now, CFG)
    expired = [g.request_id for g in await queue.grant("m", 0, now + CFG.ttl + 1)]
    assert expired == ["chat"]
    expired = [g.request_id for g in await queue.grant("m", 0, now + CFG.background_ttl + 1)]
    assert expired == ["bg"]
    expired = [g.request_id for g in await queue.grant("m", 0, now + CFG.batch_ttl + 1)]
    assert expired == ["line"]


def _request(tenant: str, max_tokens: int, deadline_ms: int = 10**13) -> Request:
    return Request(id="r", reply="x", model="m", api=Api.CHAT, stream=True,
                   body={"model": "m", "messages": [{"role": "user", "content": "hi"}],
                         "max_tokens": max_tokens},
                   created_ms=0, deadline_ms=deadline_ms, window_bytes=1 << 16,
                   window_msgs=64, tenant=tenant)


def _gate(config: Config) -> QueueGate:
    gate = QueueGate.__new__(QueueGate)
    gate.config, gate.tenants = config, TenantTable()
    return gate


def test_a_requests_cost_is_its_reserved_tokens_over_its_tiers_weight() -> None:
    gate = _gate(Config(tiers=(TierConfig(name="gold", weight=4.0, tenants=("acme",)),)))
    model = ModelConfig(name="m")
    plain = gate.cost(_request("other", 400), model)
    assert 400 < plain < 450  # the output cap and a few prompt tokens
    assert gate.cost(_request("acme", 400), model) == pytest.approx(plain / 4)
    assert gate.cost(_request("other", 4000), model) > 9 * plain


async def test_a_tier_set_with_the_tenant_cli_reaches_the_dispatcher_over_the_config(
        module_nats_url: str) -> None:
    """``tidegate tenant set acme --tier paid`` writes <P>_TENANTS; the
    dispatcher's gate follows it (a real nats-server): the named tier wins
    over the config's, and one the config no longer has falls back to it."""
    config = Config(nats=Config().nats.__class__(subject_prefix="f" + uuid.uuid4().hex[:6]),
                    tiers=(TierConfig(name="paid", weight=8.0),
                           TierConfig(name="basic", weight=2.0, tenants=("acme",))))
    gate = _gate(config)
    nc = await nats.connect(module_nats_url)
    try:
        kv = await ensure_tenants_bucket(nc.jetstream(), config)
        synced = asyncio.Event()
        watch = asyncio.create_task(watch_tenants(kv, gate.tenants, on_synced=synced.set))
        await synced.wait()
        assert gate.tier("acme") == config.tiers[1]  # the config's
        await operations.set_tenant(nc.jetstream(), config, "test",
                                    operations.tenant_settings(config, "acme", tier="paid"))
        await eventually(lambda: gate.tier("acme") == config.tiers[0], 30,
                         "the tier set in KV at the gate")
        stale = TenantSettings("acme", tier="gone")  # a tier since removed from the config
        await set_tenant(kv, stale)
        await eventually(lambda: gate.tenants.get("acme") == stale, 30, "the stale tier")
        assert gate.tier("acme") == config.tiers[1]
        with pytest.raises(UsageError, match=r"tier must name one of .*paid, basic.*'gone'"):
            operations.tenant_settings(config, "acme", tier="gone")
        watch.cancel()
    finally:
        await nc.close()
