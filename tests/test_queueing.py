"""The queue-mode store against a real redis-server: fair order, bounds,
expiry, takeover and the position codes that recover a lost grant."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

from dispatcher.queueing import QueueMode, p99
from dispatcher.quota import connect
from tidegate.config import QueueModeConfig
from tidegate.wire.classes import BACKGROUND, BATCH, INTERACTIVE

CFG = QueueModeConfig(ttft_p99=0.2, window=1.0, enter_after=2, exit_after=2, ttl=10.0,
                      max_queued=5, min_concurrency=2)


@pytest.fixture
async def queue(redis_server: Any) -> AsyncIterator[QueueMode]:
    client = connect(redis_server.url, 2.0)
    yield QueueMode(client, "t")
    await client.aclose()


async def test_round_robin_across_tenants_within_the_best_class_first(queue: QueueMode) -> None:
    now = 1000.0
    for i in range(3):
        await queue.enqueue("m", f"a{i}", "a", INTERACTIVE, "d1", now + i, CFG)
    await queue.enqueue("m", "b-batch", "b", BATCH, "d1", now + 3, CFG)
    await queue.enqueue("m", "b0", "b", INTERACTIVE, "d1", now + 4, CFG)
    grants = await queue.grant("m", 5, now + 5)
    order = [g.request_id for g in grants]
    assert all(g.granted for g in grants)
    # a and b alternate while both have interactive requests; b's batch
    # request waits for every interactive one, a's too.
    assert order == ["a0", "b0", "a1", "a2", "b-batch"]
    assert await queue.queued("m") == 0


async def test_an_interactive_request_goes_before_every_tenants_older_lower_class_work(
        queue: QueueMode) -> None:
    """Batch lines and background responses queued first, by other tenants:
    an interactive request that comes later is granted first, then
    background work, then batch (tidegate.wire.classes)."""
    now = 2000.0
    await queue.enqueue("m", "x-batch0", "x", BATCH, "d1", now, CFG)
    await queue.enqueue("m", "x-batch1", "x", BATCH, "d1", now + 1, CFG)
    await queue.enqueue("m", "y-bg", "y", BACKGROUND, "d1", now + 2, CFG)
    assert await queue.enqueue("m", "z-chat", "z", INTERACTIVE, "d1", now + 3, CFG) == (
        "queued", 1)
    assert await queue.positions("m", ["z-chat", "y-bg", "x-batch0", "x-batch1"]) == [
        1, 2, 3, 4]
    assert await queue.queued_by_class("m") == {INTERACTIVE: 1, BACKGROUND: 1, BATCH: 2}
    assert [g.request_id for g in await queue.grant("m", 1, now + 4)] == ["z-chat"]
    assert await queue.queued_by_class("m") == {INTERACTIVE: 0, BACKGROUND: 1, BATCH: 2}
    assert [g.request_id for g in await queue.grant("m", 1, now + 4)] == ["y-bg"]
    assert [g.request_id for g in await queue.grant("m", 2, now + 4)] == ["x-batch0",
                                                                            "x-batch1"]
    # a class this version does not know (off the broker, untrusted) waits last
    await queue.enqueue("m", "odd", "x", "priority-9", "d1", now + 5, CFG)
    await queue.enqueue("m", "bg", "y", BACKGROUND, "d1", now + 6, CFG)
    assert [g.request_id for g in await queue.grant("m", 2, now + 7)] == ["bg", "odd"]
    assert await queue.queued_by_class("m") == {INTERACTIVE: 0, BACKGROUND: 0, BATCH: 0}


async def test_bound_expiry_and_takeover(queue: QueueMode) -> None:
    now = 2000.0
    for i in range(5):
        assert (await queue.enqueue("m", f"r{i}", "t", INTERACTIVE, "d1", now, CFG))[0] == "queued"
    assert (await queue.enqueue("m", "r5", "t", INTERACTIVE, "d1", now, CFG))[0] == "full"
    # A redelivered request is taken over by its new dispatcher, not queued twice.
    assert await queue.enqueue("m", "r0", "t", INTERACTIVE, "d2", now, CFG) == ("queued", 0)
    assert await queue.queued("m") == 5
    grants = await queue.grant("m", 1, now + 1)
    assert [(g.request_id, g.owner, g.granted) for g in grants] == [("r0", "d2", True)]
    expired = await queue.grant("m", 0, now + CFG.ttl + 1)
    assert sorted(g.request_id for g in expired) == ["r1", "r2", "r3", "r4"]
    assert not any(g.granted for g in expired)
    # Positions tell an owner whose grant message was lost what happened.
    assert await queue.positions("m", ["r0", "r1", "nope"]) == [-1, -2, 0]
    assert (await queue.enqueue("m", "r0", "t", INTERACTIVE, "d3", now, CFG))[0] == "granted"


async def test_enters_and_leaves_queue_mode_with_hysteresis(queue: QueueMode) -> None:
    t = 5000.0
    modes = []
    # One window per second; each window's TTFT is evaluated once the next starts.
    for w, ttft in enumerate([100, 100, 300, 300, 300, 100, 150, 100, 100, 100]):
        await queue.record_ttft("m", ttft, t + w + 0.5, CFG)
        state = await queue.evaluate("m", running=4 if ttft < 200 else 9, now=t + w + 0.5,
                                     cfg=CFG)
        modes.append(state.queueing)
    # Windows are judged when they are over, so the mode lags by one window:
    # two bad windows (2, 3) enter queue mode; 150 ms is under the 200 ms
    # target but not under 0.7 x 200, so it does not count towards leaving;
    # two good windows after it (7, 8) leave.
    assert modes == [False, False, False, False, True, True, True, True, True, False]
    raw = await queue.redis.hgetall(queue.state_key("m"))
    assert raw["mode"] == "normal"
    assert int(raw["limit"]) == 4  # the jobs in flight during the last healthy window


def test_p99_nearest_rank() -> None:
    assert p99([1.0]) == 1.0
    assert p99([float(i) for i in range(1, 101)]) == 99.0
    assert p99([float(i) for i in range(1, 1001)]) == 990.0
