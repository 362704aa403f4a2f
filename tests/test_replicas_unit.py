"""workers.replicas.open_on_replicas and the breakers it feeds, with fake
backends: which replica a job opens on, what each breaker counts, when the
registry is told. The same against real processes: tests/test_replica_failover.py.
"""

from __future__ import annotations

from typing import Any

import pytest

from tidegate.errors import BackendError
from workers.replicas import (
    Breaker,
    BreakerState,
    ReplicaSet,
    open_on_replicas,
    replica_failed,
    replica_failure,
)

DOWN = BackendError(503, "connection refused", type="server_error", code="backend_unavailable")
BAD = BackendError(400, "bad", type="invalid_request_error", code="invalid_request")


class Backend:
    """Opens a stream named after itself, or raises ``fails``."""

    def __init__(self, name: str, fails: BackendError | None = None) -> None:
        self.name = name
        self.fails = fails
        self.opened = 0

    async def open(self, request: Any) -> str:
        self.opened += 1
        if self.fails is not None:
            raise self.fails
        return f"stream-{self.name}"


def replica_set(*backends: Backend, failures: int = 1) -> tuple[ReplicaSet, list[str]]:
    changes: list[str] = []
    replicas = ReplicaSet(on_change=lambda: changes.append("changed"))
    for b in backends:
        replicas.add(b.name, b, Breaker(failures=failures, cooldown=1.0))  # type: ignore[arg-type]
    return replicas, changes


REQUEST: Any = type("R", (), {"id": "job-1"})()


async def test_a_job_opens_on_its_own_replica_first() -> None:
    replicas, _ = replica_set(Backend("a"), Backend("b"))
    stream, _, name = await open_on_replicas(replicas, "b", REQUEST)
    assert (stream, name) == ("stream-b", "b")


async def test_a_dead_replica_is_counted_and_the_job_goes_on_to_the_next() -> None:
    a, b = Backend("a", fails=DOWN), Backend("b")
    replicas, changes = replica_set(a, b)
    stream, _, name = await open_on_replicas(replicas, "a", REQUEST)
    assert (stream, name) == ("stream-b", "b")
    breaker = replicas.breakers["a"]
    assert breaker.state is BreakerState.OPEN
    assert isinstance(breaker.opened_at, float)
    assert breaker.current(breaker.opened_at + 1.0) is BreakerState.HALF_OPEN
    assert replicas.state("a") == "open"
    assert replicas.state("b") == "closed"
    assert replicas.state("nobody") == "closed"
    assert changes == ["changed"], "the registry hears of a's breaker once"


async def test_with_every_replica_down_the_last_error_is_the_clients() -> None:
    replicas, _ = replica_set(Backend("a", fails=DOWN), Backend("b", fails=DOWN))
    with pytest.raises(BackendError) as exc:
        await open_on_replicas(replicas, "a", REQUEST)
    assert exc.value is DOWN
    assert [replicas.breakers[r].state for r in "ab"] == [BreakerState.OPEN] * 2


async def test_an_open_replica_past_its_cooldown_gets_the_probe() -> None:
    a, b = Backend("a"), Backend("b")
    replicas, changes = replica_set(a, b)
    breaker = replicas.breakers["a"]
    breaker.failure(0.0)  # opened long ago (monotonic time): the cooldown has passed
    _, _, name = await open_on_replicas(replicas, "a", REQUEST)
    assert name == "a"
    assert breaker.state is BreakerState.CLOSED
    assert changes == ["changed"]


async def test_a_replica_that_answers_about_the_request_is_alive() -> None:
    """A 400 is the request's fault: raised at once, no failover, and the
    replica's breaker closes (it answered); the registry hears only of a change."""
    a, b = Backend("a", fails=BAD), Backend("b")
    replicas, changes = replica_set(a, b)
    with pytest.raises(BackendError) as exc:
        await open_on_replicas(replicas, "a", REQUEST)
    assert exc.value is BAD
    assert b.opened == 0
    assert changes == [], "closed before, closed after: nothing to tell"
    replicas.breakers["a"].failure(0.0)
    with pytest.raises(BackendError):
        await open_on_replicas(replicas, "a", REQUEST)
    assert replicas.breakers["a"].state is BreakerState.CLOSED
    assert changes == ["changed"]


async def test_a_stream_broken_mid_way_goes_on_only_elsewhere() -> None:
    a, b = Backend("a"), Backend("b")
    replicas, _ = replica_set(a, b)
    replica_failed(replicas, "a", DOWN)
    assert isinstance(replicas.breakers["a"].opened_at, float)
    assert replicas.breakers["a"].state is BreakerState.OPEN
    _, _, name = await open_on_replicas(replicas, "a", REQUEST, failed="a", error=DOWN)
    assert name == "b"
    assert a.opened == 0


def test_a_5xx_of_the_replica_is_its_failure() -> None:
    assert replica_failure(BackendError(500, "HTTP 500", type="server_error",
                                        code="backend_error"))


def test_a_success_starts_the_count_of_failures_again() -> None:
    b = Breaker(failures=2, cooldown=1.0)
    b.failure(10.0)
    b.success()
    b.failure(11.0)
    assert b.state is BreakerState.CLOSED, "one failure since the success, of two"
    b.failure(12.0)
    assert b.state is BreakerState.OPEN
