"""One attempt at one batch line, seen from the runner: sans-I/O.

The runner is a client of the pipeline like an edge. :class:`LineSession` turns
the line's session messages and the clock into what the runner must send (acks)
and, at the end, one :class:`Outcome`. Unlike the edge's relay: the body is
collected whole, so a redelivered job (``Head.attempt > 1``) is simply
restarted (``Ack seq 0``), as is one a worker preempted (a ``QUEUED``
``Status`` first: it waits again); a worker the liveness probe finds dead gets a
``-NAK`` at once (:meth:`LineSession.worker_lost`); every failure is classified
for the retry policy: ``RETRY`` (5xx, worker lost, gap, silence), ``WAIT`` (a
retryable rejection, after ``retry_after``), ``ERROR`` (4xx, final).
Docs: docs/batch.md#failures-per-line.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

from tidegate.config import Config
from tidegate.wire.protocol import (
    Ack,
    Admission,
    Chunk,
    Done,
    Error,
    ErrorInfo,
    Head,
    Heartbeat,
    SessionMessage,
    Status,
)


class Phase(IntEnum):
    PUBLISHED = 0  # no dispatcher has answered yet
    ADMITTED = 1  # admitted (or queued); no worker has started it
    RUNNING = 2  # a worker's Head arrived


class Verdict(IntEnum):
    OK = 0  # the answer: body holds the response JSON
    ERROR = 1  # a final error answer (4xx)
    RETRY = 2  # transient: try again, counting against batch.max_retries
    WAIT = 3  # rejected for now (rate limit, overload): try again after retry_after


@dataclass(frozen=True, slots=True)
class Outcome:
    verdict: Verdict
    status: int = 200
    body: bytes = b""
    error: ErrorInfo | None = None
    retry_after: float = 0.0


@dataclass(frozen=True, slots=True)
class Limits:
    admission_timeout: float
    queue_timeout: float
    lost_after: float  # worker silence that means it is gone
    ack_every: float  # a keepalive ack at least this often while running
    max_body: int

    @classmethod
    def of(cls, config: Config) -> Limits:
        s = config.session
        return cls(admission_timeout=config.edge.admission_timeout,
                   queue_timeout=config.edge.queue_timeout,
                   lost_after=s.heartbeat_interval * s.worker_lost_after,
                   ack_every=s.ack_timeout / 4, max_body=config.edge.max_response_bytes)


def _transient(error: ErrorInfo) -> bool:
    return error.status >= 500 or error.status == 408


class LineSession:
    """Feed it session messages and clock ticks; it answers with the acks to
    send (``(control subject, Ack)``) and, once, the :class:`Outcome`."""

    __slots__ = ("_parts", "_size", "control", "expected_seq", "job_ack", "last_ack", "last_msg",
                 "limits", "outcome", "phase", "request_id", "started")

    def __init__(self, request_id: str, limits: Limits, now: float) -> None:
        self.request_id = request_id
        self.limits = limits
        self.phase = Phase.PUBLISHED
        self.control = ""
        self.job_ack = ""  # the job message's JetStream ack subject (Head.ack)
        self.expected_seq = 1
        self.started = self.last_msg = self.last_ack = now
        self._parts: list[bytes] = []
        self._size = 0
        self.outcome: Outcome | None = None

    def _end(self, outcome: Outcome) -> None:
        if self.outcome is None:
            self.outcome = outcome
        self._parts = []

    def feed(self, message: SessionMessage, now: float) -> list[tuple[str, Ack]]:
        if self.outcome is not None:
            return []
        kind = type(message)
        if kind is Status:
            assert isinstance(message, Status)
            if message.admission is Admission.REJECTED:
                error = message.error or ErrorInfo(503, "service_unavailable", "rejected",
                                                   "Rejected.", True, 1.0)
                if error.retryable:
                    self._end(Outcome(Verdict.WAIT, error.status, error=error,
                                      retry_after=max(error.retry_after, 0.1)))
                else:
                    self._end(Outcome(Verdict.ERROR, error.status, error=error))
            elif self.phase is Phase.PUBLISHED:
                self.phase = Phase.ADMITTED
            elif (self.phase is Phase.RUNNING and message.admission is Admission.QUEUED
                  and message.seq >= self.expected_seq - 1 > 0):
                # Its worker gave the slot to an interactive request
                # (workers.preemption; a dispatcher's status has seq 0, an
                # earlier attempt's a lower one): the line waits for a worker
                # again, under the queue timeout; its next Head starts it over.
                self.phase, self.started = Phase.ADMITTED, now
                self._parts, self._size = [], 0
            return []
        if kind is Head:
            assert isinstance(message, Head)
            return self._on_head(message, now)
        if self.phase is not Phase.RUNNING:
            self._end(Outcome(Verdict.RETRY, 502, error=ErrorInfo(
                502, "server_error", "protocol_error", "Worker output before its start.")))
            return []
        self.last_msg = now
        seq = getattr(message, "seq", 0)
        if seq != self.expected_seq:
            self._end(Outcome(Verdict.RETRY, 502, error=ErrorInfo(
                502, "server_error", "stream_gap",
                f"Lost part of the response (expected {self.expected_seq}, got {seq}).")))
            return []
        self.expected_seq = seq + 1
        if kind is Chunk:
            assert isinstance(message, Chunk)
            self._size += len(message.data)
            if self._size > self.limits.max_body:
                self._end(Outcome(Verdict.ERROR, 502, error=ErrorInfo(
                    502, "server_error", "response_too_large",
                    f"The response exceeded {self.limits.max_body} bytes.")))
                return []
            self._parts.append(message.data)
            self.last_ack = now
            return [(self.control, Ack(self.request_id, seq))]
        if kind is Done:
            body = b"".join(self._parts)
            self._end(Outcome(Verdict.OK, 200, body=body))
        elif kind is Error:
            assert isinstance(message, Error)
            error = message.error
            self._end(Outcome(Verdict.RETRY if _transient(error) else Verdict.ERROR,
                              error.status, error=error))
        else:
            assert kind is Heartbeat
        return []

    def _on_head(self, head: Head, now: float) -> list[tuple[str, Ack]]:
        self.control = head.control
        self.job_ack = head.ack if head.ack.startswith("$JS.ACK.") else ""
        self.last_msg = self.last_ack = now
        acks: list[tuple[str, Ack]] = []
        if head.attempt > 1 or self.phase is Phase.RUNNING:
            # Redelivered after its worker died: start over, and tell the new
            # worker to go ahead (it waits for this before calling the backend).
            self._parts, self._size = [], 0
            acks.append((head.control, Ack(self.request_id, 0)))
        self.phase = Phase.RUNNING
        self.expected_seq = head.seq + 1
        return acks

    def worker_lost(self, control: str, now: float) -> str:
        """The runner's watch found the worker at ``control`` gone
        (``tidegate.broker.liveness``): the subject to ``-NAK`` so that
        JetStream hands the job to another worker now, not after
        ``worker.ack_wait`` (its Head, ``attempt > 1``, restarts the line:
        nothing of it reached a client). "" when there is nothing to hand
        back: another worker's, not running, over, or (no ack subject
        known) ended here as a retry."""
        if self.outcome is not None or self.phase is not Phase.RUNNING or control != self.control:
            return ""
        if not self.job_ack:
            self._end(_lost("worker_lost", "The worker running this line died."))
            return ""
        self.last_msg = now  # the silence limit now waits for the next worker
        return self.job_ack

    def tick(self, now: float) -> list[tuple[str, Ack]]:
        """The clock checks: timeouts end the attempt (RETRY); a running one
        gets a keepalive ack so its worker knows this runner is alive."""
        if self.outcome is not None:
            return []
        lim = self.limits
        if self.phase is Phase.PUBLISHED and now - self.started >= lim.admission_timeout:
            self._end(_lost("dispatcher_unavailable",
                            f"No dispatcher answered within {lim.admission_timeout:g}s."))
        elif self.phase is Phase.ADMITTED and now - self.started >= lim.queue_timeout:
            self._end(_lost("no_worker_available",
                            f"No worker started the request within {lim.queue_timeout:g}s."))
        elif self.phase is Phase.RUNNING and now - self.last_msg >= lim.lost_after:
            self._end(_lost("worker_lost", f"The worker went silent for {lim.lost_after:g}s."))
        elif self.phase is Phase.RUNNING and now - self.last_ack >= lim.ack_every:
            self.last_ack = now
            return [(self.control, Ack(self.request_id, self.expected_seq - 1))]
        return []


def _lost(code: str, message: str) -> Outcome:
    return Outcome(Verdict.RETRY, 503, error=ErrorInfo(503, "server_error", code, message,
                                                       True, 1.0))
