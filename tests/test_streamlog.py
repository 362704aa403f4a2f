"""The stream log's sans-I/O parts: entries, event ids, the cursor, new control kinds."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tidegate.errors import ProtocolError
from tidegate.wire import streamlog
from tidegate.wire.flow import SendWindow
from tidegate.wire.protocol import (
    VERSION,
    Attach,
    Chunk,
    Detach,
    Done,
    Error,
    ErrorInfo,
    Head,
    Heartbeat,
    Kind,
    Request,
    Retransmit,
    decode_control,
    encode_chunk,
)
from tidegate.wire.streamlog import EventIds, LogCursor, LogEnd, LogEvent, LogOpen
from tidegate.wire.subjects import Subjects

OPEN = LogOpen("acme", True, 0, 1_700_000_000_000, 15.0)
ERR = ErrorInfo(503, "server_error", "x", "boom", True, 1.0)


def test_names() -> None:
    s = Subjects("tg")
    assert streamlog.stream_name(s) == "TG_STREAMLOG"
    assert streamlog.subject(s, "ab" * 12) == "tg.log." + "ab" * 12
    assert streamlog.subject(s, "x").startswith(streamlog.wildcard(s)[:-1])


def test_entries_round_trip_single_and_batched() -> None:
    assert streamlog.decode_entry(OPEN.encode()) == [OPEN]
    head = Head(1, "tg.ctl.w", 7, 1)
    assert streamlog.decode_entry(head.encode()) == [head]
    batch = msgpack.packb([VERSION, Kind.MUX, "r", encode_chunk(2, b"data: a\n\n"),
                           "r", Done(3, 1, 2, "stop").encode()])
    assert streamlog.decode_entry(batch) == [Chunk(2, b"data: a\n\n"), Done(3, 1, 2, "stop")]
    for bad in (b"\xc1", msgpack.packb([2, 0]), msgpack.packb({"v": 1}),
                msgpack.packb([VERSION, Kind.LOG_OPEN, 0]),
                msgpack.packb([VERSION, Kind.LOG_HANDBACK, 0]),
                msgpack.packb([VERSION, Kind.LOG_HANDBACK, 0, 5])):
        with pytest.raises(ProtocolError):
            streamlog.decode_entry(bad)


def test_event_ids_number_every_event_of_a_coalesced_chunk() -> None:
    ids = EventIds()
    assert ids.frame(b"data: a\n\ndata: b\n\n") == b"id: 1\ndata: a\n\nid: 2\ndata: b\n\n"
    assert ids.frame(b"data: c\n\n") == b"id: 3\ndata: c\n\n"
    assert ids.last == 3
    assert streamlog.split_events(b"data: x\n\ndata: partial") == [b"data: x\n\n",
                                                                    b"data: partial"]


def test_new_control_kinds_round_trip() -> None:
    for message in (Retransmit("r", 5), Attach("r", "reader"), Detach("r", "")):
        assert decode_control(message.encode()) == message


def test_request_carries_resumable_and_grace() -> None:
    req = Request(id="r", reply="x", model="m", api=0, stream=True, body={}, created_ms=1,  # type: ignore[arg-type]
                  deadline_ms=2, window_bytes=1024, window_msgs=4, resumable=True, grace=2.5)
    back = Request.decode(req.encode())
    assert back.resumable
    assert back.grace == 2.5
    plain = Request.decode(Request(id="r", reply="x", model="m", api=0, stream=True, body={},  # type: ignore[arg-type]
                                   created_ms=1, deadline_ms=2, window_bytes=1024,
                                   window_msgs=4).encode())
    assert not plain.resumable


def feed_all(cursor: LogCursor, entries: list[object]) -> list[object]:
    out: list[object] = []
    for entry in entries:
        out.extend(cursor.feed(entry))  # type: ignore[arg-type]
    return out


def stream(events: list[bytes], per_chunk: int) -> list[object]:
    entries: list[object] = [OPEN, Head(1, "ctl")]
    seq = 1
    for i in range(0, len(events), per_chunk):
        seq += 1
        entries.append(Chunk(seq, b"".join(events[i:i + per_chunk])))
        seq += 1
        entries.append(Heartbeat(seq))
    entries.append(Done(seq + 1, 1, len(events), "stop"))
    return entries


@given(st.integers(1, 40), st.integers(1, 7), st.integers(0, 45))
def test_cursor_yields_exactly_the_events_after(n: int, per_chunk: int, after: int) -> None:
    events = [b"data: %d\n\n" % i for i in range(n)]
    out = feed_all(LogCursor(after), stream(events, per_chunk))
    assert isinstance(out[-1], LogEnd)
    assert out[-1].done is not None
    got = out[:-1]
    assert [e.id for e in got] == list(range(after + 1, n + 1))  # type: ignore[attr-defined]
    assert [e.data for e in got] == events[after:]  # type: ignore[attr-defined]


@given(st.integers(1, 30), st.integers(1, 5), st.integers(1, 6), st.integers(0, 30))
def test_live_framing_and_replay_agree_at_any_seam(n: int, live_chunk: int, log_chunk: int,
                                                   cut: int) -> None:
    """What the relay framed up to event ``cut`` plus a replay after ``cut``
    is the framing of the whole stream: chunking never moves an id."""
    events = [b"data: %d\n\n" % i for i in range(n)]
    ids = EventIds()
    live = b"".join(ids.frame(b"".join(events[i:i + live_chunk]))
                    for i in range(0, n, live_chunk))
    whole = [b"id: %d\n%b" % (i + 1, e) for i, e in enumerate(events)]
    assert live == b"".join(whole)
    cut = min(cut, n)
    replayed = [e for e in feed_all(LogCursor(cut), stream(events, log_chunk))
                if isinstance(e, LogEvent)]
    assert whole[:cut] + [b"id: %d\n%b" % (e.id, e.data) for e in replayed] == whole


def test_cursor_gap_redelivery_duplicates_and_errors() -> None:
    c = LogCursor()
    assert feed_all(c, [OPEN, Head(1, "ctl"), Chunk(2, b"data: a\n\n")]) == [
        LogEvent(1, b"data: a\n\n")]
    assert c.control == "ctl"
    assert c.feed(Chunk(2, b"data: a\n\n")) == []  # a duplicate entry
    (end,) = c.feed(Chunk(4, b"data: c\n\n"))
    assert isinstance(end, LogEnd)
    assert end.error is not None
    assert end.error.code == "stream_gap"
    assert c.ended
    assert c.feed(Chunk(5, b"x")) == []

    c = LogCursor(after=1)  # continued after output: its seqs start again, ids go on
    assert feed_all(c, [OPEN, Head(1, "w1"), Chunk(2, b"data: a\n\n"), Chunk(3, b"data: b\n\n"),
                        Head(1, "w2"), Chunk(2, b"data: c\n\n"), Done(3, 1, 3, "stop")]) == [
        LogEvent(2, b"data: b\n\n"), LogEvent(3, b"data: c\n\n"),
        LogEnd(done=Done(3, 1, 3, "stop"))]
    assert (c.control, c.output, c.ended) == ("w2", True, True)

    c = LogCursor()
    assert feed_all(c, [OPEN, Head(1, "w1"), Head(1, "w2"), Chunk(2, b"data: a\n\n")]) == [
        LogEvent(1, b"data: a\n\n")]  # redelivered before output: follows the new worker
    assert c.control == "w2"

    c = LogCursor()  # an edge's hand-back: no event, noted for the next worker
    hand = streamlog.LogHandBack("w1")
    assert streamlog.decode_entry(hand.encode()) == [hand]
    assert feed_all(c, [OPEN, Head(1, "w1"), Chunk(2, b"data: a\n\n"), hand]) == [
        LogEvent(1, b"data: a\n\n")]
    assert (c.handed_back, c.control, c.ended) == ("w1", "w1", False)

    c = LogCursor()  # an edge ended it before any worker started
    assert feed_all(c, [OPEN, Error(0, ERR)]) == [LogEnd(error=ERR)]
    c = LogCursor()  # after a Head, an edge's Error(0) is ignored; the worker's ends it
    assert feed_all(c, [OPEN, Head(1, "w"), Error(0, ERR), Error(2, ERR)]) == [LogEnd(error=ERR)]


def test_cursor_non_streaming_body_slices() -> None:
    c = LogCursor()
    c.open = LogOpen("t", False, 0, 0, 0.0)
    out = feed_all(c, [Head(1, "w"), Chunk(2, b'{"a":'), Chunk(3, b"1}"), Done(4, 0, 0, "")])
    assert [e.data for e in out if isinstance(e, LogEvent)] == [b'{"a":', b"1}"]


def test_unbound_window_stays_open_and_keeps_accounting() -> None:
    w = SendWindow(100, 2)
    w.on_send(1, 60)
    assert not w.on_send(2, 60)
    w.unbound()
    assert w.open
    assert w.in_flight_msgs == 2
    assert w.on_send(3, 10_000)
    assert w.on_ack(3)
    assert w.in_flight_bytes == 0


@pytest.mark.parametrize("data", [
    b"\xc1",  # not msgpack
    msgpack.packb(5),  # not an array
    msgpack.packb([VERSION]),
    msgpack.packb([VERSION + 1, Kind.LOG_HANDBACK, 0, "w1"]),  # another version
    msgpack.packb([VERSION, Kind.LOG_HANDBACK, 0]),
    msgpack.packb([VERSION, Kind.LOG_HANDBACK, 0, 7]),
    msgpack.packb([VERSION, Kind.LOG_OPEN, 0, "t", True]),
    msgpack.packb([VERSION, Kind.MUX, "id"]),  # an id without its message
    msgpack.packb([VERSION, Kind.MUX, "id", "not bytes"], use_bin_type=True),
])
def test_a_malformed_log_entry_is_a_protocol_error(data: bytes) -> None:
    """The readers skip such an entry and log it (edge/logreader.py); any
    other exception would end the reader."""
    with pytest.raises(ProtocolError):
        streamlog.decode_entry(data)


def test_a_one_message_mux_batch_is_read() -> None:
    chunk = Chunk(2, b"data: a\n\n")
    batch = msgpack.packb([VERSION, Kind.MUX, "id", chunk.encode()], use_bin_type=True)
    assert streamlog.decode_entry(batch) == [chunk]


def test_a_gap_ends_the_stream_with_a_retryable_502() -> None:
    c = LogCursor()
    (end,) = feed_all(c, [OPEN, Head(1, "w"), Chunk(2, b"data: a\n\n"), Chunk(5, b"x")])[1:]
    assert end == LogEnd(error=ErrorInfo(
        502, "server_error", "stream_gap",
        "The stream log lost part of the response (expected message 3, got 5).", True, 1.0))


def test_a_trailing_piece_without_its_blank_line_is_its_own_event() -> None:
    assert streamlog.split_events(b"data: a\n\ndata: b\n\ndata: c") == [
        b"data: a\n\n", b"data: b\n\n", b"data: c"]
    assert streamlog.split_events(b"\n\ndata: a\n\n") == [b"data: a\n\n"]


def test_the_prefix_goes_once_in_front_of_the_first_event() -> None:
    ids = EventIds(streamlog.retry_field(2500))
    assert ids.frame(b"data: a\n\n") == b"retry: 2500\nid: 1\ndata: a\n\n"
    assert ids.frame(b"data: b\n\n") == b"id: 2\ndata: b\n\n"
    assert EventIds().frame(b"data: a\n\n") == b"id: 1\ndata: a\n\n"


def test_a_new_cursor_follows_no_worker_yet() -> None:
    """The reader attaches to ``control`` once it is set (edge/logreader.py)."""
    c = LogCursor()
    assert (c.control, c.handed_back, c.next_seq, c.output, c.open, c.ended) == (
        "", "", 0, False, None, False)
    assert c.output is False


def test_events_are_split_unless_the_log_opened_a_body() -> None:
    """Without a LogOpen a chunk is SSE events (ids count events); after a
    non-streaming LogOpen it is a body slice, kept whole even with a blank line."""
    c = LogCursor()
    assert feed_all(c, [Head(1, "w"), Chunk(2, b"data: a\n\ndata: b\n\n")]) == [
        LogEvent(1, b"data: a\n\n"), LogEvent(2, b"data: b\n\n")]
    body = LogOpen("t", False, 0, 0, 0.0)
    c = LogCursor()
    assert feed_all(c, [body, Head(1, "w"), Chunk(2, b'{"a":\n\n"x'), Chunk(3, b'"}')]) == [
        LogEvent(1, b'{"a":\n\n"x'), LogEvent(2, b'"}')]
    assert c.open == body


def test_a_reader_ends_the_stream_once() -> None:
    c = LogCursor()
    feed_all(c, [OPEN, Head(1, "w")])
    assert c.fail(ERR) == [LogEnd(error=ERR)]
    assert c.ended
    assert c.fail(ERR) == []
    assert c.feed(Chunk(2, b"data: a\n\n")) == []
