"""The replicas of one model in one worker, each behind a circuit breaker.

A model with several ``base_urls`` has one backend client per replica:

* failover before the first byte: a call that fails for the replica's sake
  (refused, reset, 5xx) runs on another replica within the same job; errors
  about the request (400, 429, a slow backend's 504) are answered as they are;
* a :class:`Breaker` per replica (sans-I/O): ``failures`` in a row open it,
  after ``cooldown`` (doubling up to ``max_cooldown``) one job probes it; its
  state goes into the worker registry for routing and ``tidegate status``.

A job that fails over keeps the pulling replica's slot and gives neither
adaptive limit a sample. Docs: docs/backends.md.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from enum import StrEnum

from tidegate.config import DEFAULT_FAILOVER
from tidegate.errors import BackendError
from tidegate.wire.protocol import Request
from workers.backends import Backend, BackendStream

log = logging.getLogger("tidegate.worker")


class BreakerState(StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


# Backend errors that are the replica's, not the request's: worth another replica.
FAILOVER_CODES = frozenset({"backend_unavailable", "backend_error"})


def replica_failure(error: BackendError) -> bool:
    """Whether ``error`` (before any output) says the replica is unwell."""
    return error.code in FAILOVER_CODES and error.status >= 500


@dataclass(slots=True)
class Breaker:
    """closed --failures in a row--> open --cooldown--> half_open (one probe)
    --success--> closed; --failure--> open (cooldown doubled)."""

    failures: int = 3
    cooldown: float = 1.0
    max_cooldown: float = 30.0
    state: BreakerState = BreakerState.CLOSED
    failed: int = 0
    opened_at: float = 0.0
    wait: float = 0.0
    probing: bool = False

    def current(self, now: float) -> BreakerState:
        """The state to report: an open breaker whose cooldown has passed is
        half-open, so dispatchers route work to the replica again and the
        first job that reaches it is the probe (none would come otherwise:
        routing sends nothing to an open replica)."""
        if self.state is BreakerState.OPEN and now >= self.opened_at + self.wait:
            return BreakerState.HALF_OPEN
        return self.state

    def allow(self, now: float) -> bool:
        """Whether a job may go to this replica now (a half-open probe counts)."""
        if self.state is BreakerState.CLOSED:
            return True
        if self.state is BreakerState.OPEN and now >= self.opened_at + self.wait:
            self.state = BreakerState.HALF_OPEN
            self.probing = False
        if self.state is BreakerState.HALF_OPEN and not self.probing:
            self.probing = True
            return True
        return False

    def success(self) -> None:
        self.state, self.failed, self.probing, self.wait = BreakerState.CLOSED, 0, False, 0.0

    def failure(self, now: float) -> None:
        self.failed += 1
        if self.state is BreakerState.HALF_OPEN:
            self.wait = min(self.max_cooldown, max(self.cooldown, self.wait * 2))
        elif self.failed >= self.failures:
            self.wait = self.cooldown
        else:
            return
        self.state, self.opened_at, self.probing = BreakerState.OPEN, now, False


@dataclass(slots=True)
class ReplicaSet:
    """One model's replicas as this worker serves them: backend and breaker."""

    backends: dict[str, Backend] = field(default_factory=dict)
    breakers: dict[str, Breaker] = field(default_factory=dict)
    # Called when a breaker changes state: the registry entry goes out early.
    on_change: Callable[[], None] | None = None
    # The model's ``failover``: "continue" lets a stream whose replica fails
    # mid-stream go on on another one (workers/replica_continuation.py).
    failover: str = DEFAULT_FAILOVER

    def add(self, replica: str, backend: Backend, breaker: Breaker) -> None:
        self.backends[replica] = backend
        self.breakers[replica] = breaker

    def state(self, replica: str) -> str:
        breaker = self.breakers.get(replica)
        return breaker.state.value if breaker is not None else BreakerState.CLOSED.value

    def noticed(self, replica: str, before: BreakerState) -> None:
        state = self.breakers[replica].state
        if state is not before:
            log.warning("replica %s: circuit breaker %s -> %s", replica, before.value,
                        state.value)
            if self.on_change is not None:
                self.on_change()

    def candidates(self, first: str, now: float) -> Iterator[tuple[str, Backend]]:
        """Replicas to try, in order: ``first`` if its breaker allows, then
        the others that allow; at the end, when none allowed anything,
        ``first`` anyway (a job is never refused for breakers alone: the
        client then gets the replica's own error)."""
        tried = False
        order = [first, *(r for r in self.backends if r != first)]
        for replica in order:
            if self.breakers[replica].allow(now):
                tried = True
                yield replica, self.backends[replica]
        if not tried:
            yield first, self.backends[first]

    def others(self, failed: str, now: float) -> Iterator[tuple[str, Backend]]:
        """Replicas other than ``failed`` whose breakers allow a job: where a
        stream that ``failed`` broke mid-way may go on (never back to it)."""
        for replica, backend in self.backends.items():
            if replica != failed and self.breakers[replica].allow(now):
                yield replica, backend


async def open_on_replicas(replicas: ReplicaSet, first: str, request: Request, *,
                           failed: str = "", error: BackendError | None = None
                           ) -> tuple[BackendStream, Backend, str]:
    """Open ``request``'s backend call on ``first`` or, when that replica
    fails before any output, on the next replica its breaker allows. Returns
    the stream, the backend that opened it and its replica's name; raises
    the last replica's error when none opened it, and an error about the
    request itself (400, 429, ...) at once.

    With ``failed`` (a replica whose stream broke mid-way with ``error``),
    only the other replicas are tried (:meth:`ReplicaSet.others`), and
    ``error`` is raised when none is left."""
    now = time.monotonic()
    candidates = replicas.others(failed, now) if failed else replicas.candidates(first, now)
    for name, backend in candidates:
        if error is not None:
            log.info("job %s: failing over to replica %s (%s)", request.id, name,
                     error.message)
        breaker = replicas.breakers[name]
        before = breaker.state
        try:
            stream = await backend.open(request)
        except BackendError as exc:
            if not replica_failure(exc):
                breaker.success()  # it answered: alive, whatever it thinks of the request
                replicas.noticed(name, before)
                raise
            breaker.failure(time.monotonic())
            replicas.noticed(name, before)
            error = exc
            continue
        breaker.success()
        replicas.noticed(name, before)
        return stream, backend, name
    assert error is not None
    raise error


def replica_failed(replicas: ReplicaSet, name: str, error: BackendError) -> None:
    """A stream of replica ``name`` broke mid-way with ``error``: count it in
    the replica's breaker when the error is the replica's own (a reset, a
    truncated body, an error event), as a failure to open would be."""
    breaker = replicas.breakers.get(name)
    if breaker is not None and replica_failure(error):
        before = breaker.state
        breaker.failure(time.monotonic())
        replicas.noticed(name, before)
