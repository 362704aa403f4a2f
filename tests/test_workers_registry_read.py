"""``workers_registry.read_all`` counts every worker once, with its newest entry."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import nats.errors

from tidegate.control import workers_registry
from tidegate.control.workers_registry import SlotInfo, WorkerInfo


@dataclass
class _Entry:
    key: str
    value: bytes | None


class _Watcher:
    """Replays ``initial`` then its "no more values" marker, then hands out
    ``late`` one by one (what arrives during current_entries' grace)."""

    def __init__(self, initial: list[_Entry], late: list[_Entry]) -> None:
        self._initial = [*initial, None]
        self._late = list(late)

    def __aiter__(self) -> _Watcher:
        return self

    async def __anext__(self) -> _Entry | None:
        if not self._initial:
            raise StopAsyncIteration
        return self._initial.pop(0)

    async def updates(self, timeout: float) -> _Entry | None:  # noqa: ASYNC109 (nats-py's name)
        if not self._late:
            raise nats.errors.TimeoutError
        return self._late.pop(0)

    async def stop(self) -> None:
        pass


class _KV:
    def __init__(self, watcher: _Watcher) -> None:
        self.watcher = watcher

    async def watchall(self, **_: Any) -> _Watcher:
        return self.watcher


def _entry(worker_id: str, updated: float, in_flight: int) -> _Entry:
    info = WorkerInfo(worker_id=worker_id, updated=updated,
                      models={"m": SlotInfo(10, in_flight, adaptive=True)})
    return _Entry(worker_id, info.encode())


async def test_a_heartbeat_during_the_read_does_not_count_a_worker_twice() -> None:
    now = time.time()
    kv = _KV(_Watcher([_entry("a", now - 4, 1), _entry("b", now - 1, 2)],
                      [_entry("a", now, 7)]))
    workers = await workers_registry.read_all(kv)  # type: ignore[arg-type]
    assert [w.worker_id for w in workers] == ["a", "b"]
    assert workers[0].models["m"] == SlotInfo(10, 7, adaptive=True)  # the newest of a's
    assert workers[1].models["m"].in_flight == 2


async def test_stale_entries_are_left_out() -> None:
    now = time.time()
    kv = _KV(_Watcher([_entry("a", now - 100, 1)], []))
    assert await workers_registry.read_all(kv) == []  # type: ignore[arg-type]
