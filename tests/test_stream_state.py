"""edge.stream.StreamState without a socket: phases, sequence numbers and the
clock's rules, each fed by hand and read back (the relay does the I/O)."""

from __future__ import annotations

import dataclasses

import pytest

from edge.endings import Reconnect
from edge.stream import RETRANSMIT_SPACING, TRANSITIONS, Due, Phase, StreamState
from tidegate.config import Config, EdgeConfig, SessionConfig
from tidegate.errors import ApiError
from tidegate.wire.protocol import Chunk, Done, Head, Status

CFG = Config(edge=EdgeConfig(request_timeout=600.0, admission_timeout=10.0, queue_timeout=60.0),
             session=SessionConfig(heartbeat_interval=3.0, worker_lost_after=5,
                                   ack_timeout=20.0))
HB = 3.0
LOST = HB * 5


def clock(s: StreamState, now: float, *, link_lost: bool = False, resumable: bool = False,
          stream: bool = True, control: str = "") -> Due:
    return s.clock(now, CFG, model="m", link_lost=link_lost, resumable=resumable,
                   stream=stream, control=control)


def streaming(now: float = 0.0) -> StreamState:
    s = StreamState("r", now)
    s.advance(Status)
    s.advance(Head)
    return s


def code(excinfo: pytest.ExceptionInfo[ApiError]) -> str:
    return str(excinfo.value.code)


def test_the_transition_table() -> None:
    s = StreamState("r", 0.0)
    assert s.phase is Phase.WAITING
    assert s.advance(Chunk) is Phase.WAITING, "a message not in the table moves nothing"
    assert s.advance(Status) is Phase.ADMITTED
    assert s.advance(Status) is Phase.ADMITTED, "a later queue note keeps it admitted"
    assert s.advance(Head) is Phase.STREAMING
    assert s.advance(Status) is Phase.STREAMING, "a late Status never takes a stream back"
    assert s.advance(Head) is Phase.STREAMING, "a new worker's Head after a death"
    assert s.advance(Done) is Phase.STREAMING
    lost_status = StreamState("r", 0.0)
    assert lost_status.advance(Head) is Phase.STREAMING, "its Status lost in transit"
    assert {after for after in TRANSITIONS.values()} == {Phase.ADMITTED, Phase.STREAMING}


def test_sequence_numbers_take_the_next_and_open_a_gap_past_a_lost_one() -> None:
    early = StreamState("r", 0.0)
    assert not early.check_seq(2), "output before its Head"
    assert early.gap_since > 0
    s = streaming()
    s.expected_seq = 2
    assert s.check_seq(2)
    assert s.expected_seq == 3
    assert not s.check_seq(2), "a copy of one taken"
    assert s.gap_since == 0.0
    assert not s.check_seq(5), "past a gap"
    assert s.gap_since > 0
    assert s.expected_seq == 3
    assert s.check_seq(3), "the resend fills it"
    assert s.gap_since == 0.0


def test_retransmits_are_spaced() -> None:
    s = streaming()
    assert s.retransmit_due(10.0)
    assert not s.retransmit_due(10.0 + RETRANSMIT_SPACING / 2)
    assert s.retransmit_due(10.0 + RETRANSMIT_SPACING)


@pytest.mark.parametrize(("phase", "after", "expected"), [
    (Phase.WAITING, 10.0, "dispatcher_unavailable"),
    (Phase.ADMITTED, 60.0, "no_worker_available"),
])
def test_a_request_that_waits_too_long_in_a_phase_ends(phase: Phase, after: float,
                                                       expected: str) -> None:
    s = StreamState("r", 0.0)
    if phase is Phase.ADMITTED:
        s.advance(Status)
    assert clock(s, after - 0.1, stream=False) is Due.NOTHING
    with pytest.raises(ApiError) as exc:
        clock(s, after, stream=False)
    assert code(exc) == expected
    assert exc.value.status == 503


def test_the_request_timeout_ends_any_phase() -> None:
    s = streaming()
    with pytest.raises(ApiError) as exc:
        clock(s, 600.0)
    assert (exc.value.status, code(exc)) == (504, "request_timeout")


@pytest.mark.parametrize("phase", list(Phase))
def test_an_edge_cut_from_nats_releases_a_stream_in_every_phase(phase: Phase) -> None:
    s = StreamState("r", 0.0)
    s.phase = phase
    with pytest.raises(Reconnect):
        clock(s, 1.0, link_lost=True, resumable=True)
    with pytest.raises(ApiError) as exc:
        clock(s, 1.0, link_lost=True)
    assert code(exc) == "broker_unavailable"


def test_a_silent_worker_is_asked_to_resend_then_lost() -> None:
    s = streaming()
    assert clock(s, HB * 1.5 - 0.1, stream=False) is Due.NOTHING
    assert clock(s, HB * 1.5, stream=False) is Due.RETRANSMIT, "maybe its Done was lost"
    s.asked_at = HB * 1.5
    assert clock(s, HB * 2, stream=False) is Due.NOTHING, "asked a heartbeat ago at most"
    with pytest.raises(ApiError) as exc:
        clock(s, LOST, stream=False)
    assert (code(exc), exc.value.retryable) == ("worker_lost", True)


def test_a_gap_not_filled_ends_a_stream_or_sends_a_resumable_one_to_its_log() -> None:
    s = streaming()
    s.gap_since = 1.0
    assert clock(s, 1.5, stream=False) & Due.RETRANSMIT
    with pytest.raises(Reconnect):
        clock(s, 1.0 + HB, resumable=True, stream=False)
    s.last_worker_msg = 1.0 + LOST  # the worker talks, the gap stays
    with pytest.raises(ApiError) as exc:
        clock(s, 1.0 + LOST, stream=False)
    assert code(exc) == "stream_gap"


def test_a_quiet_stream_gets_pings_and_its_worker_acks() -> None:
    s = streaming()
    assert clock(s, HB - 0.1, control="ctl") is Due.NOTHING
    assert clock(s, HB, stream=True) is Due.PING
    assert clock(s, HB, stream=False) is Due.NOTHING, "a JSON body has no comments"
    s.last_worker_msg = 4.0  # chunks came, too few for a volume ack
    assert clock(s, 20.0 / 4, stream=False, control="ctl") is Due.ACK
    assert clock(s, 20.0 / 4, stream=False) is Due.NOTHING, "no worker known: no one to ack"


def test_a_reconnect_asks_again_and_acks_and_a_copy_is_noted() -> None:
    """After this edge's NATS reconnect (to another node, after one's death)
    the next tick asks for a retransmit and acks at once (what was in flight
    through the lost connection may be gone), once per reconnect; a copy of
    a message already taken is noted, for the relay to ack again (the
    worker resent it: the edge's ack may have been lost)."""
    s = streaming()
    assert clock(s, 0.1) == Due.NOTHING
    due = s.clock(0.2, CFG, model="m", link_lost=False, resumable=False, stream=True,
                  control="", link_epoch=1)
    assert due == Due.RETRANSMIT | Due.ACK
    assert s.clock(0.3, CFG, model="m", link_lost=False, resumable=False, stream=True,
                   control="", link_epoch=1) == Due.NOTHING
    assert s.check_seq(1)
    assert not s.copies
    assert not s.check_seq(1)  # the worker sent it again
    assert s.copies
    assert not s.gap_since, "a copy is no gap"


T = 1000.0  # a monotonic clock is far from 0: a time added where it is subtracted shows


def ending(s: StreamState, now: float, **kw: bool) -> tuple[object, ...]:
    with pytest.raises(ApiError) as exc:
        clock(s, now, **kw)  # type: ignore[arg-type]
    e = exc.value
    return (type(e).__name__, e.status, e.type, e.code, e.message, e.retryable, e.retry_after)


def waiting(now: float, *, admitted: bool = False) -> StreamState:
    s = StreamState("r", now)
    if admitted:
        s.advance(Status)
    return s


def with_gap(s: StreamState, since: float) -> StreamState:
    s.gap_since = since
    s.last_worker_msg = since + LOST  # the worker talks, the gap stays
    return s


@pytest.mark.parametrize(("state", "now", "kw", "expected"), [
    (lambda: streaming(T), T + 600, {}, (
        "ApiError", 504, "server_error", "request_timeout",
        "The request exceeded the gateway's limit of 600s.", False, 0.0)),
    (lambda: streaming(T), T + 1, {"link_lost": True}, (
        "ApiError", 503, "service_unavailable", "broker_unavailable",
        "This gateway node lost its connection to the message broker.", True, 1)),
    (lambda: streaming(T), T + 1, {"link_lost": True, "resumable": True}, (
        "Reconnect", 503, "server_error", "edge_reconnect",
        "This gateway node lost its message broker; resume the stream on another.", True, 0)),
    (lambda: waiting(T), T + 10, {}, (
        "ApiError", 503, "service_unavailable", "dispatcher_unavailable",
        "No dispatcher answered within 10s.", True, 5)),
    (lambda: waiting(T, admitted=True), T + 60, {}, (
        "ApiError", 503, "service_unavailable", "no_worker_available",
        "No worker for model 'm' started the request within 60s.", True, 5)),
    (lambda: with_gap(streaming(T), T + 1), T + 1 + LOST, {}, (
        "ApiError", 502, "server_error", "stream_gap",
        "Lost part of the response (message 1) and the worker did not send it again "
        "within 15s.", True, 1)),
    (lambda: streaming(T), T + LOST, {}, (
        "ApiError", 502, "server_error", "worker_lost",
        "The worker running this request went silent for 15s.", True, 1)),
])
def test_every_ending_says_what_a_client_sees(state: object, now: float, kw: dict[str, bool],
                                             expected: tuple[object, ...]) -> None:
    """Status, type, code, message and retry advice: what the client's error
    body and Retry-After carry (docs/errors.md)."""
    assert ending(state(), now, **kw) == expected  # type: ignore[operator]


def test_the_clock_reads_durations_since_each_event() -> None:
    s = streaming(T)
    assert clock(s, T + HB - 0.1, control="ctl") is Due.NOTHING
    s.last_worker_msg = T + 4.0  # chunks came, too few for a volume ack
    assert clock(s, T + 20.0 / 4.5, stream=False, control="ctl") is Due.NOTHING
    assert clock(s, T + 20.0 / 4, stream=False, control="ctl") is Due.ACK
    s = streaming(T)
    s.gap_since = T + 0.5  # a resumable stream's gap is given a heartbeat to fill
    assert clock(s, T + 1.0, resumable=True, stream=False) is Due.RETRANSMIT
    with pytest.raises(Reconnect):
        clock(s, T + 0.5 + HB, resumable=True, stream=False)


@pytest.mark.parametrize("phase", [Phase.WAITING, Phase.ADMITTED])
def test_a_reconnect_before_the_head_asks_every_worker_until_it_comes(phase: Phase) -> None:
    """A short response sent whole (Head to Done) while this edge reconnected
    leaves nothing to show it was lost: the edge asks every worker for it
    (from seq 1) each tick, for a worker's tail-keeping time, then waits as
    before; a Head ends the asking. Without this, the request waited out
    queue_timeout (the chaos run's streams with no end)."""
    s = StreamState("r", 0.0)
    if phase is Phase.ADMITTED:
        s.advance(Status)

    cfg = dataclasses.replace(CFG, edge=dataclasses.replace(CFG.edge, admission_timeout=60.0))

    def tick(now: float, epoch: int = 1) -> Due:
        return s.clock(now, cfg, model="m", link_lost=False, resumable=False, stream=False,
                       control="", link_epoch=epoch)

    assert tick(0.5, epoch=0) is Due.NOTHING, "no reconnect, nothing to ask"
    assert tick(1.0) is Due.RETRANSMIT
    assert s.expected_seq == 1, "from the Head on"
    assert tick(2.0) is Due.RETRANSMIT, "asked again while nothing came"
    assert tick(1.0 + LOST - 0.1) is Due.RETRANSMIT
    assert tick(1.0 + LOST) is Due.NOTHING, "no worker kept it: stop asking"
    assert tick(1.0 + LOST + 1) is Due.NOTHING
    assert not s.check_seq(3), "later output asks again"
    assert tick(1.0 + LOST + 2) is Due.RETRANSMIT
    s.advance(Head)
    assert s.check_seq(1)
    s.last_worker_msg = 1.0 + LOST + 2.5
    assert tick(1.0 + LOST + 3) is Due.NOTHING, "the Head came: streaming as usual"


def test_what_is_due_at_once_is_asked_at_once() -> None:
    s = streaming(T)
    s.gap_since = T + 0.1
    assert clock(s, T + 5.0, control="ctl") == Due.RETRANSMIT | Due.PING | Due.ACK
    s = streaming(T)
    due = s.clock(T + HB, CFG, model="m", link_lost=False, resumable=False, stream=True,
                  control="", link_epoch=1)
    assert due == Due.RETRANSMIT | Due.PING | Due.ACK
    early = StreamState("r", T)
    assert not early.check_seq(2), "output before its Head: every worker is asked"
    early.gap_since = T + 0.1
    assert clock(early, T + HB) == Due.RETRANSMIT | Due.PING


def test_an_earlier_deliverys_late_output_is_counted_apart_from_copies() -> None:
    """``stale`` feeds the edge's count of dropped earlier-delivery messages."""
    s = streaming(T)
    s.floor_seq, s.expected_seq = 5, 7
    assert s.stale == 0
    assert not s.check_seq(3)
    assert not s.check_seq(4)
    assert (s.stale, s.copies) == (2, False)
    assert not s.check_seq(6)
    assert (s.stale, s.copies) == (2, True)
