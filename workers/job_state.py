"""One job's lifecycle without I/O: its phase, its outcome, and how it ends.

:class:`JobState` is what a worker knows of one job's course; :class:`workers.job.Job`
extends it and does the I/O its answers ask for, as ``edge.relay`` does with
``edge.stream``, so the rules are tested without NATS or a backend
(``tests/test_job_state.py``). Phases (:data:`TRANSITIONS`)::

    HEAD --go-ahead--> CALLING --opened--> STREAMING --done | failed--> ENDED
      +--a redelivery its edge did not confirm: dropped-----------------^
    CALLING --refused--> ENDED    STREAMING --failover--> STREAMING
    any --aborted--> ENDED        (a cancel ends it by :func:`cancelled`)

How a job ends, what it reports and how its message is settled is an
:class:`Ending`. Docs: docs/lifecycle.md#a-workers-job.
"""

from __future__ import annotations

from enum import Enum, IntEnum
from typing import NamedTuple

from tidegate.errors import ApiError
from tidegate.wire.protocol import DUPLICATE_DELIVERY
from workers.fencing import FENCED

WORKER_SHUTDOWN = "worker_shutdown"
ACK_TIMEOUT = "ack_timeout"
# POST /v1/streams/{id}/cancel: every reader gets a final event saying so.
CLIENT_CANCEL = "client_cancel"
# A resumable stream's last reader left and none came back within the grace.
RESUME_GRACE = "resume_grace"
# A background response's slot taken for an interactive request (workers.preemption).
PREEMPTED = "preempted"
# Seconds a preempted job's message stays out of JetStream's delivery: the
# interactive request it made room for is pulled first.
REQUEUE_DELAY = 2.0


class Phase(IntEnum):
    HEAD = 0  # its Head is out; a redelivery waits for its edge's word
    CALLING = 1  # the backend call is being opened
    STREAMING = 2  # the backend answers; output goes to the edge
    ENDED = 3  # its outcome is known


class Event(Enum):
    GO_AHEAD = "go_ahead"  # a first delivery, or a redelivery its edge confirmed
    EDGE_SILENT = "edge_silent"  # a redelivery its edge did not confirm
    OPENED = "opened"
    REFUSED = "refused"  # the backend refused the call
    FAILOVER = "failover"  # the call failed and goes on on another replica
    DONE = "done"
    FAILED = "failed"  # the backend failed mid-stream, nowhere to go on
    ABORTED = "aborted"  # the job raised (tidegate.broker.poison)


# (phase, event) -> the phase after it; an event a phase does not list leaves it.
TRANSITIONS: dict[tuple[Phase, Event], Phase] = {
    (Phase.HEAD, Event.GO_AHEAD): Phase.CALLING,
    (Phase.HEAD, Event.EDGE_SILENT): Phase.ENDED,
    (Phase.CALLING, Event.OPENED): Phase.STREAMING,
    (Phase.CALLING, Event.REFUSED): Phase.ENDED,
    (Phase.STREAMING, Event.FAILOVER): Phase.STREAMING,
    (Phase.STREAMING, Event.DONE): Phase.ENDED,
    (Phase.STREAMING, Event.FAILED): Phase.ENDED,
    **{(phase, Event.ABORTED): Phase.ENDED for phase in Phase if phase is not Phase.ENDED},
}

# The outcome (usage record, jobs metric) an ending event gives.
OUTCOMES = {Event.EDGE_SILENT: "dropped", Event.REFUSED: "error", Event.DONE: "done",
            Event.FAILED: "error", Event.ABORTED: "error"}


class Settle(Enum):
    ACK = "ack"  # done with: JetStream forgets it
    NAK = "nak"  # another worker runs it at once
    REQUEUE = "requeue"  # handed back in its log, continued after a pause (preempted)
    NONE = "none"  # not a word: another copy owns the stream, or NATS cut this worker off


class Ending(NamedTuple):
    """How a job ends: its ``outcome`` (a usage record is stored when
    ``report``, else only the jobs metric counts it), the ``error`` its edge
    and its log's readers are sent last (if any), then its message's ``settle``."""

    outcome: str
    report: bool
    error: ApiError | None
    settle: Settle


# Why a job ended early, as the error its edge (and the stream log) is sent.
CANCEL_ERRORS = {
    WORKER_SHUTDOWN: ApiError(503, "The worker running this request is shutting down.",
                              type="server_error", code=WORKER_SHUTDOWN, retryable=True,
                              retry_after=1),
    ACK_TIMEOUT: ApiError(503, "The client stopped acknowledging output; the request was "
                               "cancelled.", type="server_error", code=ACK_TIMEOUT,
                          retryable=True, retry_after=1),
    CLIENT_CANCEL: ApiError(409, "The stream was cancelled (POST /v1/streams/{id}/cancel).",
                            type="invalid_request_error", code="stream_cancelled"),
    RESUME_GRACE: ApiError(409, "Every reader of this resumable stream left, and none came "
                                "back within its grace; generation was stopped.",
                           type="invalid_request_error", code="stream_abandoned"),
}


def cancelled(reason: str, chunks_sent: int) -> Ending:
    """A job cancelled for ``reason`` after ``chunks_sent`` chunks.

    | reason | ending |
    | --- | --- |
    | fenced, duplicate delivery | nothing: NATS cut it off, or another copy owns the stream |
    | worker shutdown, no output | handed back (nak): another worker runs it at once |
    | preempted | requeued: no record, no error; a later copy continues its log |
    | anything else | a ``cancelled`` record, the reason's error if it has one, ack |
    """
    if reason in (FENCED, DUPLICATE_DELIVERY):
        return Ending(reason, False, None, Settle.NONE)
    if reason == PREEMPTED:
        return Ending(PREEMPTED, False, None, Settle.REQUEUE)
    if reason == WORKER_SHUTDOWN and not chunks_sent:
        return Ending("handed_back", False, None, Settle.NAK)
    return Ending("cancelled", True, CANCEL_ERRORS.get(reason), Settle.ACK)


class JobState:
    """The sans-I/O part of one job (see the module docstring)."""

    phase: Phase
    outcome: str  # "" until it ends; then OUTCOMES' or an Ending's

    def _start_state(self) -> None:
        self.phase = Phase.HEAD
        self.outcome = ""

    def advance(self, event: Event) -> Phase:
        """The phase after ``event`` (:data:`TRANSITIONS`); an ending event
        sets the outcome, once."""
        after = TRANSITIONS.get((self.phase, event))
        if after is None:
            return self.phase
        self.phase = after
        if after is Phase.ENDED and not self.outcome:
            self.outcome = OUTCOMES[event]
        return after

    def ending(self) -> Ending:
        """How a job that ran to its end (not cancelled) ends: its outcome
        recorded, its message acked."""
        return Ending(self.outcome, bool(self.outcome), None, Settle.ACK)
