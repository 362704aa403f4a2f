"""The edge's per-request mailbox (edge.session)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import msgpack
import pytest

from edge import session as edge_session
from edge.session import Session, SessionTable
from tidegate.telemetry.untrusted import BadInput
from tidegate.wire.protocol import (
    Admission,
    Chunk,
    Done,
    Head,
    Heartbeat,
    SessionMessage,
    Status,
)

NEVER = 3600.0  # a tick interval that never fires within a test
INBOX = "tg.out.edge-1."


@pytest.fixture
async def session() -> AsyncIterator[Session]:
    s = Session("r1", NEVER)
    yield s
    s.close()


@pytest.fixture
async def table(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[SessionTable]:
    # A fresh drop accounting per test: its log is rate-limited per reason.
    monkeypatch.setattr(edge_session, "BAD_INPUT", BadInput("edge", edge_session.log))
    t = SessionTable(INBOX)
    yield t
    for rid in list(t._sessions):
        t.close(t._sessions[rid])


# --------------------------------------------------------------------------
# Session
# --------------------------------------------------------------------------


async def test_take_empty(session: Session) -> None:
    assert session.take() == []
    assert session.ticked is False


async def test_feed_then_take_in_order(session: Session) -> None:
    messages: list[SessionMessage] = [
        Status(Admission.ADMITTED), Head(1, "tg.ctl.w1", 5), Chunk(2, b"a"), Chunk(3, b"b"),
        Done(4, 1, 2, "stop"),
    ]
    for m in messages:
        session.feed(m)
    assert session.take() == messages
    assert session.take() == []


async def test_take_returns_only_what_arrived_since_last_take(session: Session) -> None:
    session.feed(Chunk(2, b"a"))
    assert session.take() == [Chunk(2, b"a")]
    session.feed(Chunk(3, b"b"))
    session.feed(Heartbeat(4))
    assert session.take() == [Chunk(3, b"b"), Heartbeat(4)]


async def test_wait_returns_at_once_when_messages_pending(session: Session) -> None:
    session.feed(Chunk(2, b"x"))
    async with asyncio.timeout(1):
        await session.wait()
    assert session.take() == [Chunk(2, b"x")]


async def test_feed_wakes_a_waiter(session: Session) -> None:
    waiter = asyncio.create_task(session.wait())
    await asyncio.sleep(0)
    assert not waiter.done()
    session.feed(Chunk(2, b"x"))
    async with asyncio.timeout(1):
        await waiter
    assert session.take() == [Chunk(2, b"x")]


async def test_several_feeds_before_the_waiter_runs(session: Session) -> None:
    waiter = asyncio.create_task(session.wait())
    await asyncio.sleep(0)
    for seq in range(2, 6):
        session.feed(Chunk(seq, b"."))
    async with asyncio.timeout(1):
        await waiter
    assert [m.seq for m in session.take()] == [2, 3, 4, 5]


async def test_wait_blocks_without_messages_or_tick(session: Session) -> None:
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.05):
            await session.wait()
    # A cancelled wait leaves the session usable.
    session.feed(Chunk(2, b"x"))
    async with asyncio.timeout(1):
        await session.wait()


async def test_tick_wakes_a_waiter() -> None:
    session = Session("r1", 0.01)
    try:
        async with asyncio.timeout(1):
            await session.wait()
        assert session.ticked is True
        assert session.take() == []
        assert session.take_tick() is True
        assert session.ticked is False
        assert session.take_tick() is False
    finally:
        session.close()


async def test_tick_while_not_waiting_is_remembered() -> None:
    session = Session("r1", 0.01)
    try:
        await asyncio.sleep(0.05)
        assert session.ticked is True
        async with asyncio.timeout(0.5):
            await session.wait()  # returns at once
    finally:
        session.close()


async def test_ticks_repeat() -> None:
    session = Session("r1", 0.01)
    try:
        for _ in range(3):
            async with asyncio.timeout(1):
                await session.wait()
            assert session.take() == []
            assert session.take_tick() is True
    finally:
        session.close()


async def test_take_returns_messages_and_keeps_the_tick() -> None:
    session = Session("r1", 0.01)
    try:
        await asyncio.sleep(0.03)
        session.feed(Chunk(2, b"x"))
        assert session.ticked is True
        assert session.take() == [Chunk(2, b"x")]
        assert session.ticked is True  # the clock checks still have to run
        assert session.take_tick() is True
        assert session.ticked is False
    finally:
        session.close()


async def test_close_stops_ticks() -> None:
    session = Session("r1", 0.01)
    session.close()
    await asyncio.sleep(0.05)
    assert session.ticked is False


async def test_close_after_ticks_stops_the_rescheduled_tick() -> None:
    session = Session("r1", 0.01)
    await asyncio.sleep(0.035)
    assert session.take() == []
    assert session.take_tick() is True
    session.close()
    await asyncio.sleep(0.05)
    assert session.ticked is False


# --------------------------------------------------------------------------
# SessionTable
# --------------------------------------------------------------------------


async def test_open_and_close(table: SessionTable) -> None:
    assert len(table) == 0
    a = table.open("a", NEVER)
    b = table.open("b", NEVER)
    assert len(table) == 2
    assert a.request_id == "a"
    table.close(a)
    assert len(table) == 1
    table.close(a)  # twice is harmless
    assert len(table) == 1
    table.close(b)
    assert len(table) == 0


async def test_dispatch_routes_by_last_token(table: SessionTable) -> None:
    a = table.open("a1b2", NEVER)
    b = table.open("c3d4", NEVER)
    table.dispatch(INBOX + "a1b2", Chunk(2, b"for a").encode())
    table.dispatch(INBOX + "c3d4", Chunk(2, b"for b").encode())
    table.dispatch(INBOX + "a1b2", Done(3, 1, 1, "stop").encode())
    assert a.take() == [Chunk(2, b"for a"), Done(3, 1, 1, "stop")]
    assert b.take() == [Chunk(2, b"for b")]


async def test_dispatch_wakes_the_waiting_session(table: SessionTable) -> None:
    session = table.open("r1", NEVER)
    waiter = asyncio.create_task(session.wait())
    await asyncio.sleep(0)
    table.dispatch(INBOX + "r1", Heartbeat(2).encode())
    async with asyncio.timeout(1):
        await waiter
    assert session.take() == [Heartbeat(2)]


@pytest.mark.parametrize("subject", [
    INBOX + "unknown",
    INBOX + "r1.extra",
    INBOX + "r",
    INBOX,
])
async def test_dispatch_drops_unknown_ids(table: SessionTable, subject: str) -> None:
    session = table.open("r1", NEVER)
    table.dispatch(subject, Chunk(2, b"x").encode())
    assert session.take() == []
    assert len(table) == 1


async def test_dispatch_after_close_is_dropped(table: SessionTable) -> None:
    session = table.open("r1", NEVER)
    table.close(session)
    table.dispatch(INBOX + "r1", Chunk(2, b"late").encode())
    assert session.take() == []


@pytest.mark.parametrize("payload", [
    b"",
    b"\xc1",
    b"garbage",
    msgpack.packb([99, 2, 1, b"x"]),  # future version
    msgpack.packb([1, 6, 0, "r1", 3]),  # an Ack: control, not session
    msgpack.packb({"v": 1}),
])
async def test_dispatch_drops_malformed_payload(table: SessionTable, payload: bytes,
                                                caplog: pytest.LogCaptureFixture) -> None:
    session = table.open("r1", NEVER)
    with caplog.at_level(logging.WARNING, logger="tidegate.edge"):
        table.dispatch(INBOX + "r1", payload)
    assert session.take() == []
    assert any("r1" in r.getMessage() for r in caplog.records)
    # The session still works afterwards.
    table.dispatch(INBOX + "r1", Chunk(2, b"ok").encode())
    assert session.take() == [Chunk(2, b"ok")]


async def test_dispatch_with_the_service_prefix_convention() -> None:
    # edge.service builds the table from the inbox wildcard minus its "*".
    from tidegate.wire.subjects import Subjects

    subjects = Subjects("blue")
    table = SessionTable(subjects.edge_inbox("e9")[:-1])
    session = table.open("abc", NEVER)
    try:
        table.dispatch(subjects.out("e9", "abc"), Chunk(2, b"x").encode())
        assert session.take() == [Chunk(2, b"x")]
    finally:
        table.close(session)


# --------------------------------------------------------------------------
# Session.direct: chunks written without waking the relay
# --------------------------------------------------------------------------


class FakeDirect:
    """Stands in for Relay._direct: records what it is offered, accepts while
    ``accept`` is true."""

    def __init__(self, accept: bool = True) -> None:
        self.accept = accept
        self.offered: list[Chunk] = []

    def __call__(self, chunk: Chunk) -> bool:
        self.offered.append(chunk)
        return self.accept


async def test_direct_takes_a_chunk_without_queueing_or_waking(session: Session) -> None:
    direct = FakeDirect()
    session.direct = direct
    waiter = asyncio.create_task(session.wait())
    await asyncio.sleep(0)
    session.feed(Chunk(2, b"a"))
    session.feed(Chunk(3, b"b"))
    await asyncio.sleep(0.01)
    assert direct.offered == [Chunk(2, b"a"), Chunk(3, b"b")]
    assert not waiter.done(), "a chunk written directly must not wake the relay"
    assert session.take() == []
    waiter.cancel()


async def test_direct_declining_queues_and_wakes(session: Session) -> None:
    direct = FakeDirect(accept=False)
    session.direct = direct
    waiter = asyncio.create_task(session.wait())
    await asyncio.sleep(0)
    session.feed(Chunk(2, b"a"))
    async with asyncio.timeout(1):
        await waiter
    assert direct.offered == [Chunk(2, b"a")]
    assert session.take() == [Chunk(2, b"a")]


@pytest.mark.parametrize("message", [
    Head(1, "tg.ctl.w1"), Heartbeat(4), Done(4, 1, 2, "stop"), Status(Admission.QUEUED, 3),
])
async def test_direct_is_offered_only_chunks(session: Session, message: SessionMessage) -> None:
    direct = FakeDirect()
    session.direct = direct
    session.feed(message)
    assert direct.offered == []
    assert session.take() == [message]


async def test_nothing_overtakes_a_queued_message(session: Session) -> None:
    direct = FakeDirect(accept=False)
    session.direct = direct
    session.feed(Chunk(2, b"a"))  # declined: queued
    direct.accept = True
    session.feed(Chunk(3, b"b"))  # would be accepted, but 2 waits in the queue
    session.feed(Heartbeat(4))
    session.feed(Chunk(5, b"c"))
    assert direct.offered == [Chunk(2, b"a")]
    assert session.take() == [Chunk(2, b"a"), Chunk(3, b"b"), Heartbeat(4), Chunk(5, b"c")]
    session.feed(Chunk(6, b"d"))  # queue empty again: offered
    assert direct.offered == [Chunk(2, b"a"), Chunk(6, b"d")]
    assert session.take() == []


async def test_without_direct_every_chunk_queues(session: Session) -> None:
    direct = FakeDirect()
    session.direct = direct
    session.feed(Chunk(2, b"a"))
    session.direct = None  # the relay holds taken messages
    session.feed(Chunk(3, b"b"))
    assert direct.offered == [Chunk(2, b"a")]
    assert session.take() == [Chunk(3, b"b")]


# --------------------------------------------------------------------------
# SessionTable: multiplexed messages (<p>.out.<edge>.mux)
# --------------------------------------------------------------------------


def mux(*frames: tuple[str, bytes]) -> bytes:
    from tidegate.wire.protocol import VERSION, Kind

    return msgpack.packb([VERSION, Kind.MUX, *(x for frame in frames for x in frame)])


async def test_dispatch_mux_routes_each_frame_in_order(table: SessionTable) -> None:
    a, b = table.open("a1", NEVER), table.open("b2", NEVER)
    table.dispatch(INBOX + "mux", mux(
        ("a1", Head(1, "tg.ctl.w1").encode()),
        ("b2", Head(1, "tg.ctl.w2").encode()),
        ("a1", Chunk(2, b"a-2").encode()),
        ("b2", Chunk(2, b"b-2").encode()),
        ("a1", Chunk(3, b"a-3").encode()),
        ("a1", Done(4, 1, 2, "stop").encode()),
        ("b2", Heartbeat(3).encode()),
    ))
    assert a.take() == [Head(1, "tg.ctl.w1"), Chunk(2, b"a-2"), Chunk(3, b"a-3"),
                        Done(4, 1, 2, "stop")]
    assert b.take() == [Head(1, "tg.ctl.w2"), Chunk(2, b"b-2"), Heartbeat(3)]


async def test_dispatch_mux_wakes_each_waiting_session(table: SessionTable) -> None:
    sessions = [table.open(f"r{i}", NEVER) for i in range(3)]
    waiters = [asyncio.create_task(s.wait()) for s in sessions]
    await asyncio.sleep(0)
    table.dispatch(INBOX + "mux", mux(*((f"r{i}", Heartbeat(2).encode()) for i in range(3))))
    async with asyncio.timeout(1):
        await asyncio.gather(*waiters)
    assert [s.take() for s in sessions] == [[Heartbeat(2)]] * 3


async def test_dispatch_mux_uses_a_sessions_direct_writer(table: SessionTable) -> None:
    session = table.open("r1", NEVER)
    direct = FakeDirect()
    session.direct = direct
    table.dispatch(INBOX + "mux", mux(("r1", Chunk(5, b"x").encode()),
                                      ("r1", Chunk(6, b"y").encode()),
                                      ("r1", Done(7, 1, 2, "stop").encode())))
    assert direct.offered == [Chunk(5, b"x"), Chunk(6, b"y")]
    assert session.take() == [Done(7, 1, 2, "stop")]


async def test_dispatch_mux_drops_frames_of_unknown_sessions(table: SessionTable) -> None:
    session = table.open("r1", NEVER)
    closed = table.open("gone", NEVER)
    table.close(closed)
    table.dispatch(INBOX + "mux", mux(("unknown", Chunk(2, b"?").encode()),
                                      ("r1", Chunk(2, b"mine").encode()),
                                      ("gone", Chunk(9, b"late").encode()),
                                      ("r1", Chunk(3, b"mine too").encode())))
    assert session.take() == [Chunk(2, b"mine"), Chunk(3, b"mine too")]
    assert closed.take() == []
    assert len(table) == 1


async def test_dispatch_mux_skips_a_malformed_frame(table: SessionTable,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    a, b = table.open("a1", NEVER), table.open("b2", NEVER)
    with caplog.at_level(logging.WARNING, logger="tidegate.edge"):
        table.dispatch(INBOX + "mux", mux(("a1", Chunk(2, b"first").encode()),
                                          ("b2", b"garbage"),
                                          ("a1", msgpack.packb([1, 6, 0, "a1", 3])),  # an Ack
                                          ("b2", Chunk(2, b"after").encode()),
                                          ("a1", Chunk(3, b"last").encode())))
    assert a.take() == [Chunk(2, b"first"), Chunk(3, b"last")]
    assert b.take() == [Chunk(2, b"after")]
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    # Both frames were dropped; the second of the same reason within the
    # rate limit's interval is counted, not logged.
    assert len(errors) == 1
    assert "b2" in errors[0]


@pytest.mark.parametrize("payload", [
    b"",
    b"garbage",
    msgpack.packb({"v": 1}),
    msgpack.packb([1, 8, "r1"]),  # odd length
    msgpack.packb([99, 8, "r1", Chunk(2, b"x").encode()]),  # future version
    Chunk(2, b"x").encode(),  # a plain session message on the mux subject
])
async def test_dispatch_mux_drops_a_malformed_mux_message(
        table: SessionTable, payload: bytes, caplog: pytest.LogCaptureFixture) -> None:
    session = table.open("r1", NEVER)
    with caplog.at_level(logging.WARNING, logger="tidegate.edge"):
        table.dispatch(INBOX + "mux", payload)
    assert session.take() == []
    assert any("mux" in r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING)
    # The table still works afterwards, for mux and plain messages alike.
    table.dispatch(INBOX + "mux", mux(("r1", Chunk(2, b"ok").encode())))
    table.dispatch(INBOX + "r1", Chunk(3, b"ok too").encode())
    assert session.take() == [Chunk(2, b"ok"), Chunk(3, b"ok too")]


async def test_dispatch_mux_with_a_bad_frame_structure_logs(
        table: SessionTable, caplog: pytest.LogCaptureFixture) -> None:
    session = table.open("r1", NEVER)
    bad = msgpack.packb([1, 8, "r1", Chunk(2, b"x").encode(), 7, b"not an id"])
    with caplog.at_level(logging.WARNING, logger="tidegate.edge"):
        table.dispatch(INBOX + "mux", bad)
    assert any("mux subject" in r.getMessage() for r in caplog.records)
    session.take()
    table.dispatch(INBOX + "mux", mux(("r1", Chunk(3, b"ok").encode())))
    assert session.take() == [Chunk(3, b"ok")]


async def test_only_the_mux_token_is_unpacked(table: SessionTable) -> None:
    """A session message on a per-request subject is never read as a mux message,
    nor a mux message on a per-request subject as a session message."""
    session = table.open("r1", NEVER)
    table.dispatch(INBOX + "r1", mux(("r1", Chunk(2, b"x").encode())))
    assert session.take() == []
    from tidegate.wire.subjects import MUX_TOKEN, Subjects

    assert Subjects("tg").edge_mux("edge-1") == INBOX + MUX_TOKEN
    table.dispatch(Subjects("tg").edge_mux("edge-1"), mux(("r1", Chunk(2, b"y").encode())))
    assert session.take() == [Chunk(2, b"y")]
