"""The registry heartbeat's early put (tidegate.control.registry.heartbeat with ``wake``).

Workers wake it when an adaptive limit moves, so the batch runner, which
fills exactly the free slots workers advertise, sees a grown limit at once
instead of a whole heartbeat interval later. A fake KV counts the puts.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from tidegate.control import registry


class _Kv:
    def __init__(self) -> None:
        self.puts: list[float] = []
        self.first = asyncio.Event()

    async def put(self, key: str, value: bytes) -> None:
        self.puts.append(time.monotonic())
        self.first.set()

    async def delete(self, key: str) -> None:
        pass


class _Info:
    def encode(self) -> bytes:
        return b"{}"


async def _beat(kv: _Kv, wake: asyncio.Event | None) -> asyncio.Task[None]:
    task = asyncio.create_task(registry.heartbeat(kv, _Info, lambda _: "w", 30.0, "test", wake))
    await asyncio.wait_for(kv.first.wait(), 5.0)
    return task


async def test_a_wake_sends_the_next_put_early_but_spaced() -> None:
    kv, wake = _Kv(), asyncio.Event()
    task = await _beat(kv, wake)
    woken = time.monotonic()
    wake.set()
    await asyncio.sleep(registry.EARLY_SPACING + 0.3)
    assert len(kv.puts) == 2  # not 30 s later
    assert kv.puts[1] - kv.puts[0] >= registry.EARLY_SPACING - 0.01
    assert kv.puts[1] - woken < registry.EARLY_SPACING + 0.2
    await asyncio.sleep(0.8)
    assert len(kv.puts) == 2  # no wake, no put until the interval
    task.cancel()


async def test_without_wake_the_interval_holds() -> None:
    kv = _Kv()
    task: Any = await _beat(kv, None)
    await asyncio.sleep(0.7)
    assert len(kv.puts) == 1
    task.cancel()


async def test_a_cancel_as_the_wake_is_set_ends_the_heartbeat() -> None:
    """A worker stopping sets the wake and cancels its heartbeat in one loop
    iteration: the heartbeat must end (Python 3.11's wait_for dropped such a
    cancel, and the worker's shutdown hung until it was killed)."""
    kv, wake = _Kv(), asyncio.Event()
    task = await _beat(kv, wake)
    await asyncio.sleep(registry.EARLY_SPACING + 0.1)  # waiting on the wake now
    wake.set()
    task.cancel()
    done, _ = await asyncio.wait({task}, timeout=5.0)
    if not done:
        task.cancel()  # the failure: do not leave it running
    assert done, "the heartbeat went on after its cancel"
