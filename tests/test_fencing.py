"""workers.fencing: when a worker fences itself, and when it lifts the fence."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any, cast

from tests.poll import eventually
from workers.fencing import GRACE, Fence


@dataclass
class _Client:
    is_connected: bool = True
    is_closed: bool = False


def test_a_disconnect_fences_after_the_grace_once_and_a_reconnect_lifts() -> None:
    calls: list[str] = []
    fence = Fence(calls.append)
    fence.on_link(False)
    assert fence.down_since is not None
    start = fence.down_since
    fence.check(start + GRACE / 2)
    assert not fence.fenced  # a reconnect to another node may still come
    fence.on_link(False)  # nats-py may report one loss twice: one grace, one fencing
    fence.check(start + GRACE)
    fence.check(start + GRACE + 1)
    assert fence.fenced
    assert calls == [f"nats disconnected for {GRACE:.1f}s"]
    fence.on_link(True)
    assert not fence.fenced
    fence.on_link(False)
    fence.check(time.monotonic() + GRACE)
    assert fence.fencings == 2


def test_a_reconnect_within_the_grace_keeps_the_jobs() -> None:
    """A worker whose NATS node died reconnects to another in milliseconds:
    its jobs go on (the edges ask for what was lost in transit)."""
    calls: list[str] = []
    backs: list[bool] = []
    fence = Fence(calls.append, lambda: backs.append(True))
    fence.on_link(False)
    fence.on_link(True)
    fence.check(time.monotonic() + 10 * GRACE)
    assert not fence.fenced
    assert calls == []
    # And every reconnect is told (the pool resends what its jobs hold unacked).
    assert backs == [True]


async def test_watch_fences_a_client_that_is_not_connected_without_a_callback() -> None:
    calls: list[str] = []
    fence = Fence(calls.append)
    nc = _Client()
    task = asyncio.create_task(fence.watch(cast(Any, nc)))
    try:
        await asyncio.sleep(0.6)
        assert not fence.fenced  # connected: nothing happens
        nc.is_connected = False  # RECONNECTING, its callback not yet called
        await eventually(lambda: fence.fenced, 5 + GRACE, "fenced by the watch")
        (why,) = calls
        assert why.startswith("nats disconnected for ")
        nc.is_connected = True
        await eventually(lambda: not fence.fenced, 5, "lifted once connected again")
        nc.is_connected, nc.is_closed = False, True  # closed at shutdown: not a cut
        await asyncio.sleep(0.6)
        assert not fence.fenced
    finally:
        task.cancel()
