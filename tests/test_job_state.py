"""A job's course without I/O (workers.job_state): its phases and how it ends."""

from __future__ import annotations

import pytest

from tidegate.wire.protocol import DUPLICATE_DELIVERY
from workers.fencing import FENCED
from workers.job_state import (
    ACK_TIMEOUT,
    CANCEL_ERRORS,
    CLIENT_CANCEL,
    PREEMPTED,
    RESUME_GRACE,
    TRANSITIONS,
    WORKER_SHUTDOWN,
    Ending,
    Event,
    JobState,
    Phase,
    Settle,
    cancelled,
)


def state() -> JobState:
    s = JobState()
    s._start_state()
    return s


def run(*events: Event) -> JobState:
    s = state()
    for event in events:
        s.advance(event)
    return s


@pytest.mark.parametrize(("events", "phase", "outcome"), [
    ((), Phase.HEAD, ""),
    ((Event.GO_AHEAD,), Phase.CALLING, ""),
    ((Event.EDGE_SILENT,), Phase.ENDED, "dropped"),
    ((Event.GO_AHEAD, Event.REFUSED), Phase.ENDED, "error"),
    ((Event.GO_AHEAD, Event.OPENED), Phase.STREAMING, ""),
    ((Event.GO_AHEAD, Event.OPENED, Event.DONE), Phase.ENDED, "done"),
    ((Event.GO_AHEAD, Event.OPENED, Event.FAILED), Phase.ENDED, "error"),
    ((Event.GO_AHEAD, Event.OPENED, Event.FAILOVER, Event.FAILOVER, Event.DONE), Phase.ENDED,
     "done"),
    ((Event.GO_AHEAD, Event.OPENED, Event.ABORTED), Phase.ENDED, "error"),
    ((Event.ABORTED,), Phase.ENDED, "error"),
])
def test_a_course_of_events_ends_in_its_phase_and_outcome(events: tuple[Event, ...],
                                                         phase: Phase, outcome: str) -> None:
    s = run(*events)
    assert (s.phase, s.outcome) == (phase, outcome)


@pytest.mark.parametrize("late", list(Event))
def test_an_ended_job_stays_as_it_ended(late: Event) -> None:
    """Its outcome is told once: a poison-job abort after a Done (or any
    other late event) changes nothing."""
    s = run(Event.GO_AHEAD, Event.OPENED, Event.DONE)
    assert s.advance(late) is Phase.ENDED
    assert s.outcome == "done"


@pytest.mark.parametrize(("phase", "event"), [
    (Phase.HEAD, Event.OPENED), (Phase.HEAD, Event.DONE), (Phase.CALLING, Event.GO_AHEAD),
    (Phase.CALLING, Event.DONE), (Phase.STREAMING, Event.REFUSED),
    (Phase.STREAMING, Event.EDGE_SILENT)])
def test_an_event_out_of_turn_leaves_the_phase(phase: Phase, event: Event) -> None:
    s = state()
    s.phase = phase
    assert s.advance(event) is phase
    assert s.outcome == ""


def test_every_ending_event_has_an_outcome_and_only_ended_has_none_out() -> None:
    ending = {event for (_, event), after in TRANSITIONS.items() if after is Phase.ENDED}
    assert ending == {Event.EDGE_SILENT, Event.REFUSED, Event.DONE, Event.FAILED, Event.ABORTED}
    assert not [key for key in TRANSITIONS if key[0] is Phase.ENDED]


def test_a_job_that_ran_to_its_end_is_recorded_and_acked() -> None:
    assert run(Event.GO_AHEAD, Event.OPENED, Event.DONE).ending() == Ending(
        "done", True, None, Settle.ACK)
    assert run(Event.EDGE_SILENT).ending() == Ending("dropped", True, None, Settle.ACK)
    # no outcome (it never reached one): acked, nothing recorded
    assert state().ending() == Ending("", False, None, Settle.ACK)


@pytest.mark.parametrize(("reason", "sent", "expected"), [
    (FENCED, 5, Ending(FENCED, False, None, Settle.NONE)),
    (DUPLICATE_DELIVERY, 0, Ending(DUPLICATE_DELIVERY, False, None, Settle.NONE)),
    (WORKER_SHUTDOWN, 0, Ending("handed_back", False, None, Settle.NAK)),
    (WORKER_SHUTDOWN, 3, Ending("cancelled", True, CANCEL_ERRORS[WORKER_SHUTDOWN], Settle.ACK)),
    (ACK_TIMEOUT, 0, Ending("cancelled", True, CANCEL_ERRORS[ACK_TIMEOUT], Settle.ACK)),
    (CLIENT_CANCEL, 9, Ending("cancelled", True, CANCEL_ERRORS[CLIENT_CANCEL], Settle.ACK)),
    (RESUME_GRACE, 9, Ending("cancelled", True, CANCEL_ERRORS[RESUME_GRACE], Settle.ACK)),
    (PREEMPTED, 0, Ending(PREEMPTED, False, None, Settle.REQUEUE)),
    (PREEMPTED, 7, Ending(PREEMPTED, False, None, Settle.REQUEUE)),
    ("client_gone", 2, Ending("cancelled", True, None, Settle.ACK)),
])
def test_a_cancelled_job_ends_by_its_reason(reason: str, sent: int, expected: Ending) -> None:
    assert cancelled(reason, sent) == expected


def test_the_cancel_errors_say_whether_to_retry() -> None:
    retry = {reason: (e.status, e.retryable) for reason, e in CANCEL_ERRORS.items()}
    assert retry == {WORKER_SHUTDOWN: (503, True), ACK_TIMEOUT: (503, True),
                     CLIENT_CANCEL: (409, False), RESUME_GRACE: (409, False)}
