"""One response's stream state, without I/O: phases, sequence numbers, clocks.

:class:`StreamState` is what the edge knows of one request: its phase, the next
session message, a gap, what its clock says at each tick. :class:`edge.relay.Relay`
extends it and does the I/O its answers ask for, so every rule is tested without
a socket (``tests/test_stream_state.py``). Phases (:data:`TRANSITIONS`)::

    WAITING --Status(admitted|queued)--> ADMITTED --Head--> STREAMING --Done--> (end)
       +--Head (its Status lost)--------------------------^
       +-- rejected / Error / timeout / worker lost / client gone --> (end)

Ends are exceptions: an :class:`tidegate.errors.ApiError` or
:class:`edge.endings.Reconnect`. The relay inherits (not holds) the state so a
chunk's check stays one attribute read on ``self``. Docs: docs/lifecycle.md.
"""

from __future__ import annotations

import logging
import time
from enum import IntEnum, IntFlag

from edge.endings import Reconnect
from tidegate.config import Config
from tidegate.errors import ApiError, unavailable
from tidegate.wire.protocol import Head, Status

log = logging.getLogger("tidegate.edge")

# At most one retransmit request per this many seconds: a burst of messages
# past one gap asks once.
RETRANSMIT_SPACING = 0.25


class Phase(IntEnum):
    WAITING = 0  # published; no dispatcher has answered
    ADMITTED = 1  # admitted or queued; no worker has started it
    STREAMING = 2  # a worker's Head arrived


# (phase, message kind) -> the phase after it. A Head moves any phase to
# STREAMING (a Status lost in transit, or a new worker's Head after a
# death); a Status only moves WAITING on (a queued request's later position
# notes keep it ADMITTED, and a late one never takes a stream back).
TRANSITIONS: dict[tuple[Phase, type], Phase] = {
    (Phase.WAITING, Status): Phase.ADMITTED,
    (Phase.WAITING, Head): Phase.STREAMING,
    (Phase.ADMITTED, Head): Phase.STREAMING,
    (Phase.STREAMING, Head): Phase.STREAMING,
}


class Due(IntFlag):
    """What a tick asks the relay to do (any of them, in this order)."""

    NOTHING = 0
    RETRANSMIT = 1  # ask the worker(s) to send again from expected_seq (if retransmit_due)
    PING = 2  # write a keep-alive (": ping") to the client
    ACK = 4  # tell the worker this edge is alive (an ack, even with nothing new)


class StreamState:
    """The sans-I/O part of one response (see the module docstring)."""

    # One per open stream, 10,000 of them on an edge: no per-instance dict.
    __slots__ = ("asked_at", "copies", "expected_seq", "floor_seq", "gap_since", "last_ack",
                 "last_worker_msg", "last_write", "link_epoch", "phase", "request_id",
                 "stale", "started")

    def __init__(self, request_id: str, now: float) -> None:
        self.request_id = request_id
        self.phase = Phase.WAITING
        self.expected_seq = 1
        # A lost worker message (see check_seq): when the gap opened (0 = no
        # gap) and when this edge last asked for a retransmit.
        self.gap_since = 0.0
        self.asked_at = 0.0
        # A copy of a message already taken came (a worker resent what it
        # holds unacked: this edge's acks may have been lost): ack again.
        self.copies = False
        # The seq of the Head followed (flow.first_seq): a message below it
        # is an earlier delivery's, sent late (a fenced worker's buffer flushed
        # at the heal), and never part of the response; ``stale`` counts them.
        self.floor_seq = 1
        self.stale = 0
        self.link_epoch = 0  # this edge's NATS reconnects, as last seen (Link.epoch)
        self.started = self.last_worker_msg = self.last_write = self.last_ack = now

    def advance(self, kind: type) -> Phase:
        """The phase after a message of ``kind`` (:data:`TRANSITIONS`)."""
        self.phase = TRANSITIONS.get((self.phase, kind), self.phase)
        return self.phase

    def check_seq(self, seq: int) -> bool:
        """Whether the message with ``seq`` is the next one (take it). A copy
        of one already taken (a retransmit overlapping what arrived) is
        dropped; one past a gap (a core NATS message lost in transit) is
        dropped too, and the gap is to be asked for again from its first
        missing seq (:meth:`retransmit_due`): the worker keeps every message
        not acked yet, so the stream goes on byte-exact. Only a gap that
        stays open until the worker counts as lost ends it (``stream_gap``)."""
        if self.phase is not Phase.STREAMING:
            # Output before its Head: the Head was lost in transit. It names
            # the worker, so every worker is asked (Subjects.retransmit_any)
            # to send again from seq 1; the request's own deadlines still apply.
            if not self.gap_since:
                self.gap_since = time.monotonic()
                log.info("request %s: worker output before its Head (lost in transit?)",
                         self.request_id)
            return False
        expected = self.expected_seq
        if seq == expected:
            self.expected_seq = seq + 1
            self.gap_since = 0.0
            return True
        if seq < expected:
            if seq < self.floor_seq:
                self.stale += 1
            else:
                self.copies = True
        elif not self.gap_since:
            self.gap_since = time.monotonic()
            log.info("request %s: message %d lost in transit (got %d); asking for it again",
                     self.request_id, expected, seq)
        return False

    def retransmit_due(self, now: float) -> bool:
        """Whether to ask for a retransmit now (at most every
        :data:`RETRANSMIT_SPACING` s); True counts as asked."""
        if now - self.asked_at < RETRANSMIT_SPACING:
            return False
        self.asked_at = now
        return True

    def clock(self, now: float, cfg: Config, *, model: str, link_lost: bool,
              resumable: bool, stream: bool, control: str, link_epoch: int = 0) -> Due:
        """The clock's rules, run about once a second per request (not per
        chunk): raises the ending they reach, else says what is due.
        ``resumable``: the stream numbers its events and has a log to resume
        from; ``control``: the worker's control subject, once known;
        ``link_epoch``: this edge's NATS reconnects so far."""
        if now >= self.started + cfg.edge.request_timeout:
            raise ApiError(504, f"The request exceeded the gateway's limit of "
                                f"{cfg.edge.request_timeout:g}s.",
                           type="server_error", code="request_timeout")
        if link_lost:  # cut from NATS: nothing more can come
            if resumable:
                # In every phase: the log was opened and the request stored
                # before the relay began (edge/publish.py), so another edge's
                # resume reads whatever the worker writes, from event 1 if it
                # had not started, or the clean end if none picks it up.
                raise Reconnect("lost its message broker")
            raise unavailable("This gateway node lost its connection to the message broker.",
                              code="broker_unavailable", retry_after=1)
        phase = self.phase
        if phase is Phase.WAITING and now >= self.started + cfg.edge.admission_timeout:
            raise unavailable(f"No dispatcher answered within {cfg.edge.admission_timeout:g}s.",
                              code="dispatcher_unavailable", retry_after=5)
        if phase is Phase.ADMITTED and now >= self.started + cfg.edge.queue_timeout:
            raise unavailable(f"No worker for model '{model}' started the "
                              f"request within {cfg.edge.queue_timeout:g}s.",
                              code="no_worker_available", retry_after=5)
        heartbeat = cfg.session.heartbeat_interval
        lost_after = heartbeat * cfg.session.worker_lost_after
        due = Due.NOTHING
        if link_epoch != self.link_epoch:
            # This edge reconnected (to another node, after one's death): what
            # was in flight through the lost connection, the worker's output
            # and this edge's acks, may be gone. Streaming, ask and ack at once
            # rather than at the silence rule (1.5 heartbeats) or the ack timer.
            # Before a Head, the whole response may have gone that way (a short
            # one, Head to Done, sent while this edge reconnected): nothing
            # would come to show the gap, and the request would wait out
            # queue_timeout. So the Head is missing until it comes, as when
            # output comes first (check_seq), and every worker is asked.
            self.link_epoch = link_epoch
            if phase is Phase.STREAMING:
                due |= Due.RETRANSMIT | Due.ACK
            elif not self.gap_since:
                self.gap_since = now
        if phase is not Phase.STREAMING and self.gap_since:
            if now - self.gap_since >= lost_after:
                # Asked for a worker's tail-keeping time (workers.tails) and
                # nothing came: no worker has it yet. Its next output asks again.
                self.gap_since = 0.0
            else:
                due |= Due.RETRANSMIT  # the Head is missing (see check_seq)
        if phase is Phase.STREAMING:
            if self.gap_since and resumable and now - self.gap_since >= heartbeat:
                # A resumable stream has its log: rather than wait for a resend
                # that may not come (a worker that no longer keeps messages for
                # this connection), send the client to resume from the log.
                raise Reconnect()
            if self.gap_since and now - self.gap_since >= lost_after:
                raise ApiError(502, f"Lost part of the response (message {self.expected_seq}) "
                                    f"and the worker did not send it again within "
                                    f"{lost_after:g}s.", type="server_error",
                               code="stream_gap", retryable=True, retry_after=1)
            silent = now - self.last_worker_msg
            if silent >= lost_after:
                raise ApiError(502, f"The worker running this request went silent for "
                                    f"{lost_after:g}s.", type="server_error",
                               code="worker_lost", retryable=True, retry_after=1)
            if self.gap_since or (silent >= 1.5 * heartbeat and now - self.asked_at >= heartbeat):
                # A gap still open, or a worker silent past its heartbeat: the
                # last message(s) may be what was lost (a Done, say), with
                # nothing behind them to show the gap. Asking costs nothing
                # when nothing was lost.
                due |= Due.RETRANSMIT
        if stream and now - self.last_write >= heartbeat:
            due |= Due.PING
        if control and now - self.last_ack >= cfg.session.ack_timeout / 4:
            # Ack on time as well as on volume, even with nothing new: slow
            # output never reaches half a window, and a worker in a long
            # prefill must still learn that this edge is alive.
            due |= Due.ACK
        return due
