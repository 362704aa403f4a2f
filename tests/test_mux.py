"""Many sessions' messages in one NATS message (tidegate.mux), without a
broker: the Outbox with a recording publish, decode_mux and the batch bound.
The same against a real nats-server and the whole pipeline: test_mux_nats.py."""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict
from collections.abc import AsyncIterator

import msgpack
import pytest

from edge.session import SessionTable
from tests.poll import eventually
from tidegate.errors import ProtocolError
from tidegate.wire.mux import Outbox, batch_limit, decode_mux
from tidegate.wire.protocol import (
    VERSION,
    Admission,
    Chunk,
    Done,
    Head,
    Heartbeat,
    Kind,
    Status,
    decode_session,
    encode_chunk,
)
from tidegate.wire.subjects import Subjects

NEVER = 3600.0  # a session tick interval that never fires within a test


class RecordingPublish:
    """Stands in for ``nc.publish``: records every (subject, data); raises for
    the calls numbered in ``fail_calls`` (1-based)."""

    def __init__(self, fail_calls: tuple[int, ...] = ()) -> None:
        self.calls: list[tuple[str, bytes]] = []
        self.attempts = 0
        self.fail_calls = fail_calls

    async def __call__(self, subject: str, data: bytes) -> None:
        self.attempts += 1
        if self.attempts in self.fail_calls:
            raise ConnectionError("connection closed")
        self.calls.append((subject, data))

    def subjects(self) -> list[str]:
        return [subject for subject, _ in self.calls]

    def frames(self, subject: str | None = None) -> list[tuple[str, bytes]]:
        return [frame for s, data in self.calls if subject in (None, s)
                for frame in decode_mux(data)]


@pytest.fixture
async def publish() -> RecordingPublish:
    return RecordingPublish()


@pytest.fixture
async def outbox(publish: RecordingPublish) -> AsyncIterator[Outbox]:
    box = Outbox(publish)
    box.start()
    yield box
    await box.close()


def msg(i: int, size: int = 8) -> bytes:
    """A distinct message body of about ``size`` bytes."""
    return (b"%06d" % i).ljust(size, b".")


# --------------------------------------------------------------------------
# Outbox with a recording publish
# --------------------------------------------------------------------------


async def test_one_iteration_gives_one_publish_per_subject(
        outbox: Outbox, publish: RecordingPublish) -> None:
    outbox.put("tg.out.e1.mux", "r1", msg(1))
    outbox.put("tg.out.e2.mux", "r2", msg(2))
    outbox.put("tg.out.e1.mux", "r3", msg(3))
    outbox.put("tg.out.e2.mux", "r2", msg(4))
    outbox.put("tg.out.e1.mux", "r1", msg(5))
    assert publish.calls == []  # put never publishes by itself
    await outbox.flush()
    assert sorted(publish.subjects()) == ["tg.out.e1.mux", "tg.out.e2.mux"]
    assert publish.frames("tg.out.e1.mux") == [("r1", msg(1)), ("r3", msg(3)), ("r1", msg(5))]
    assert publish.frames("tg.out.e2.mux") == [("r2", msg(2)), ("r2", msg(4))]
    assert outbox.published == 2
    assert outbox.frames == 5


async def test_the_wire_format_is_one_flat_array(
        outbox: Outbox, publish: RecordingPublish) -> None:
    outbox.put("s", "r1", b"a")
    outbox.put("s", "r2", b"bc")
    await outbox.flush()
    [(_, data)] = publish.calls
    assert msgpack.unpackb(data) == [VERSION, int(Kind.MUX), "r1", b"a", "r2", b"bc"]


async def test_puts_after_a_flush_go_in_a_new_message(
        outbox: Outbox, publish: RecordingPublish) -> None:
    outbox.put("s", "r1", msg(1))
    outbox.put("s", "r1", msg(2))
    await outbox.flush()
    assert len(publish.calls) == 1
    outbox.put("s", "r1", msg(3))
    await outbox.flush()
    assert len(publish.calls) == 2
    assert list(decode_mux(publish.calls[1][1])) == [("r1", msg(3))]
    assert publish.frames() == [("r1", msg(1)), ("r1", msg(2)), ("r1", msg(3))]
    assert (outbox.published, outbox.frames) == (2, 3)


async def test_flush_with_nothing_put_publishes_nothing(
        outbox: Outbox, publish: RecordingPublish) -> None:
    async with asyncio.timeout(1):
        await outbox.flush()
    assert publish.calls == []
    # The positive event that gives a stray publish its chance: publishes go
    # out in order, so once the next put's flush is out, anything the empty
    # flush had started would be ahead of it.
    outbox.put("s", "r1", msg(1))
    await outbox.flush()
    assert publish.frames() == [("r1", msg(1))]
    assert (outbox.published, outbox.frames) == (1, 1)


async def test_flusher_publishes_without_being_asked(
        outbox: Outbox, publish: RecordingPublish) -> None:
    """No flush(): the running flusher publishes within a few loop iterations."""
    outbox.put("s", "r1", msg(1))
    for _ in range(10):
        await asyncio.sleep(0)
        if publish.calls:
            break
    assert publish.frames() == [("r1", msg(1))]


async def test_puts_from_several_tasks_in_one_iteration_share_a_message(
        outbox: Outbox, publish: RecordingPublish) -> None:
    """Jobs woken in the same loop iteration add to the same batch."""
    go = asyncio.Event()

    async def job(rid: str) -> None:
        await go.wait()
        outbox.put("s", rid, msg(int(rid[1:])))

    jobs = [asyncio.create_task(job(f"r{i}")) for i in range(20)]
    await asyncio.sleep(0)  # every job now waits on the event
    go.set()  # wakes all twenty in the next iteration
    await asyncio.gather(*jobs)
    await outbox.flush()
    assert len(publish.calls) == 1
    assert sorted(publish.frames()) == sorted((f"r{i}", msg(i)) for i in range(20))


async def test_the_flusher_waits_for_the_rest_of_the_iteration(
        outbox: Outbox, publish: RecordingPublish) -> None:
    """A put scheduled behind the flusher's wake-up, in the same loop
    iteration, still joins the batch (the flusher yields once first)."""
    outbox.put("s", "r1", msg(1))
    asyncio.get_running_loop().call_soon(outbox.put, "s", "r2", msg(2))
    await outbox.flush()
    assert len(publish.calls) == 1
    assert publish.frames() == [("r1", msg(1)), ("r2", msg(2))]


async def test_a_latency_budget_gathers_puts_across_iterations(
        publish: RecordingPublish) -> None:
    """With ``delay``, puts in later loop iterations (other streams' chunks
    arriving a little later) join the waiting batch; without, each goes alone."""
    for delay, messages in ((NEVER, 1), (0.0, 5)):
        publish.calls.clear()
        box = Outbox(publish, delay=delay)
        box.start()
        try:
            for i in range(5):
                box.put("s", f"r{i}", msg(i))
                for _ in range(5):  # the flusher without a budget publishes here
                    await asyncio.sleep(0)
            if delay:
                assert publish.calls == [], "a batch waits out its budget"
            await box.flush()  # ... unless someone flushes: the budget is cut short
        finally:
            await box.close()
        assert len(publish.calls) == messages
        assert publish.frames() == [(f"r{i}", msg(i)) for i in range(5)]


async def test_the_latency_budget_is_kept(publish: RecordingPublish) -> None:
    """A message put into an idle outbox leaves on its own once the budget
    is spent, without a flush."""
    box = Outbox(publish, delay=0.01)
    box.start()
    try:
        box.put("s", "r1", msg(1))
        await eventually(lambda: publish.calls, 30, "the batch published after its budget")
    finally:
        await box.close()
    assert publish.frames() == [("r1", msg(1))]


async def test_a_full_batch_does_not_wait_out_the_budget(publish: RecordingPublish) -> None:
    box = Outbox(publish, max_bytes=1000, delay=NEVER)
    box.start()
    try:
        frames = [(f"{i:024x}", msg(i, 100)) for i in range(8)]  # 7 fill a batch
        for rid, m in frames:
            box.put("s", rid, m)
        # The full batch leaves at once, and what was open behind it with it.
        await eventually(lambda: publish.frames() == frames, 30, "the full batch published")
    finally:
        await box.close()
    assert len(publish.calls) == 2


async def test_batches_are_cut_at_max_bytes_in_order(publish: RecordingPublish) -> None:
    max_bytes = 1000
    box = Outbox(publish, max_bytes=max_bytes)
    box.start()
    try:
        frames = [(f"{i % 3:024x}", msg(i, 100)) for i in range(50)]
        for rid, m in frames:
            box.put("s", rid, m)
        await box.flush()
    finally:
        await box.close()
    # 50 frames of 100 + 40 counted bytes: 7 per 1000-byte batch.
    assert len(publish.calls) == 8
    assert publish.subjects() == ["s"] * 8
    for _, data in publish.calls:
        assert len(data) <= max_bytes
    assert [len(list(decode_mux(data))) for _, data in publish.calls] == [7] * 7 + [1]
    assert publish.frames() == frames
    assert (box.published, box.frames) == (8, 50)


async def test_an_oversized_message_goes_alone(publish: RecordingPublish) -> None:
    box = Outbox(publish, max_bytes=1000)
    box.start()
    try:
        box.put("s", "r1", msg(1))
        box.put("s", "r1", msg(2, 5000))
        box.put("s", "r1", msg(3))
        box.put("s", "r1", msg(4))
        await box.flush()
    finally:
        await box.close()
    batches = [list(decode_mux(data)) for _, data in publish.calls]
    assert batches == [[("r1", msg(1))], [("r1", msg(2, 5000))],
                       [("r1", msg(3)), ("r1", msg(4))]]
    for batch, (_, data) in zip(batches, publish.calls, strict=True):
        assert len(data) <= 1000 or len(batch) == 1


async def test_cut_batches_of_several_subjects_keep_each_subjects_order(
        publish: RecordingPublish) -> None:
    box = Outbox(publish, max_bytes=600)
    box.start()
    try:
        sent: dict[str, list[tuple[str, bytes]]] = defaultdict(list)
        for i in range(90):
            subject = f"tg.out.e{i % 3}.mux"
            frame = (f"r{i % 7}", msg(i, 60 + i))
            sent[subject].append(frame)
            box.put(subject, *frame)
            if i % 25 == 24:
                await asyncio.sleep(0)  # some in later iterations
        await box.flush()
    finally:
        await box.close()
    assert len(publish.calls) > 3  # cut, not one message per subject
    for subject, frames in sent.items():
        assert publish.frames(subject) == frames


async def test_close_publishes_what_is_pending(publish: RecordingPublish) -> None:
    box = Outbox(publish)
    box.start()
    box.put("a", "r1", msg(1))
    box.put("b", "r2", msg(2))
    await box.close()
    assert sorted(publish.subjects()) == ["a", "b"]
    assert publish.frames("a") == [("r1", msg(1))]
    assert publish.frames("b") == [("r2", msg(2))]
    assert box._task is None
    await box.close()  # twice is harmless


async def test_flush_without_start_publishes_directly(publish: RecordingPublish) -> None:
    box = Outbox(publish)
    box.put("s", "r1", msg(1))
    box.put("s", "r2", msg(2))
    await box.flush()
    assert publish.frames() == [("r1", msg(1)), ("r2", msg(2))]
    assert (box.published, box.frames) == (1, 2)


async def test_a_failed_publish_is_logged_and_the_outbox_goes_on(
        caplog: pytest.LogCaptureFixture) -> None:
    publish = RecordingPublish(fail_calls=(1,))
    box = Outbox(publish)
    box.start()
    try:
        with caplog.at_level(logging.WARNING, logger="tidegate.mux"):
            box.put("tg.out.e1.mux", "r1", msg(1))
            box.put("tg.out.e1.mux", "r1", msg(2))
            async with asyncio.timeout(2):
                await box.flush()
        assert publish.attempts == 1
        assert publish.calls == []
        warnings = [r for r in caplog.records if r.name == "tidegate.mux"]
        assert len(warnings) == 1
        assert warnings[0].levelno == logging.WARNING
        assert "2 messages" in warnings[0].getMessage()
        assert "tg.out.e1.mux" in warnings[0].getMessage()
        assert (box.published, box.frames) == (0, 0)
        # Later puts still go out.
        box.put("tg.out.e1.mux", "r1", msg(3))
        async with asyncio.timeout(2):
            await box.flush()
        assert publish.frames() == [("r1", msg(3))]
        assert (box.published, box.frames) == (1, 1)
        assert box._task is not None
        assert not box._task.done()
    finally:
        await box.close()


async def test_a_failed_publish_spoils_only_its_own_batch(
        caplog: pytest.LogCaptureFixture) -> None:
    publish = RecordingPublish(fail_calls=(2,))
    box = Outbox(publish, max_bytes=200)
    box.start()
    try:
        with caplog.at_level(logging.WARNING, logger="tidegate.mux"):
            for i in range(9):  # three batches of three 20-byte messages
                box.put("s", "r1", msg(i, 20))
            async with asyncio.timeout(2):
                await box.flush()
    finally:
        await box.close()
    assert publish.attempts == 3
    assert publish.frames() == [("r1", msg(i, 20)) for i in (0, 1, 2, 6, 7, 8)]
    assert (box.published, box.frames) == (2, 6)
    assert any("could not publish 3 messages" in r.getMessage() for r in caplog.records)


async def test_round_trip_of_real_session_messages(
        outbox: Outbox, publish: RecordingPublish) -> None:
    messages = [
        ("a" * 24, Head(1, "tg.ctl.w1", 17, 1).encode()),
        ("b" * 24, Status(Admission.ADMITTED).encode()),
        ("a" * 24, encode_chunk(2, b'data: {"x": 1}\n\n')),
        ("a" * 24, Heartbeat(3).encode()),
        ("a" * 24, Chunk(4, b"\x00\xff binary").encode()),
        ("a" * 24, Done(5, 3, 2, "stop").encode()),
    ]
    for rid, m in messages:
        outbox.put("tg.out.e1.mux", rid, m)
    await outbox.flush()
    [(_, data)] = publish.calls
    decoded = [(rid, decode_session(m)) for rid, m in decode_mux(data)]
    assert decoded == [
        ("a" * 24, Head(1, "tg.ctl.w1", 17, 1)),
        ("b" * 24, Status(Admission.ADMITTED)),
        ("a" * 24, Chunk(2, b'data: {"x": 1}\n\n')),
        ("a" * 24, Heartbeat(3)),
        ("a" * 24, Chunk(4, b"\x00\xff binary")),
        ("a" * 24, Done(5, 3, 2, "stop")),
    ]


async def test_outbox_feeds_an_edge_session_table(publish: RecordingPublish) -> None:
    """What the worker puts, the edge's table routes: Outbox -> dispatch."""
    subjects = Subjects("tg")
    table = SessionTable(subjects.edge_inbox("e1")[:-1])
    a, b = table.open("aa11", NEVER), table.open("bb22", NEVER)
    box = Outbox(publish)
    box.start()
    try:
        mux = subjects.edge_mux("e1")
        box.put(mux, "aa11", Head(1, "tg.ctl.w").encode())
        box.put(mux, "bb22", Head(1, "tg.ctl.w").encode())
        for seq in range(2, 6):
            box.put(mux, "aa11", encode_chunk(seq, b"a%d" % seq))
            box.put(mux, "bb22", encode_chunk(seq, b"b%d" % seq))
        box.put(mux, "aa11", Done(6, 1, 4, "stop").encode())
        await box.flush()
        for subject, data in publish.calls:
            table.dispatch(subject, data)
        assert a.take() == [Head(1, "tg.ctl.w"), *(Chunk(s, b"a%d" % s) for s in range(2, 6)),
                            Done(6, 1, 4, "stop")]
        assert b.take() == [Head(1, "tg.ctl.w"), *(Chunk(s, b"b%d" % s) for s in range(2, 6))]
    finally:
        await box.close()
        table.close(a)
        table.close(b)


# --------------------------------------------------------------------------
# decode_mux
# --------------------------------------------------------------------------


@pytest.mark.parametrize("data", [
    pytest.param(b"", id="empty"),
    pytest.param(b"\xc1", id="never-used-byte"),
    pytest.param(b"garbage", id="not-msgpack"),
    pytest.param(msgpack.packb([1, 8, "r", b"x"]) + b"\x01", id="trailing-bytes"),
    pytest.param(msgpack.packb({"v": 1, "kind": 8}), id="map"),
    pytest.param(msgpack.packb(8), id="int"),
    pytest.param(msgpack.packb(b"bytes"), id="bin"),
    pytest.param(msgpack.packb([]), id="empty-array"),
    pytest.param(msgpack.packb([1]), id="version-only"),
    pytest.param(msgpack.packb([1, 8, "r1"]), id="odd-length"),
    pytest.param(msgpack.packb([1, 8, "r1", b"x", "r2"]), id="odd-length-longer"),
    pytest.param(msgpack.packb([2, 8, "r1", b"x"]), id="future-version"),
    pytest.param(msgpack.packb([0, 8, "r1", b"x"]), id="version-zero"),
    pytest.param(msgpack.packb([1, 2, "r1", b"x"]), id="chunk-kind"),
    pytest.param(msgpack.packb([1, 9, "r1", b"x"]), id="unknown-kind"),
    pytest.param(msgpack.packb([1, 8, b"r1", b"x"]), id="bin-request-id"),
    pytest.param(msgpack.packb([1, 8, 5, b"x"]), id="int-request-id"),
    pytest.param(msgpack.packb([1, 8, "r1", "x"]), id="str-message"),
    pytest.param(msgpack.packb([1, 8, "r1", None]), id="nil-message"),
    pytest.param(msgpack.packb([1, 8, "r1", b"x", "r2", [b"y"]]), id="bad-second-frame"),
])
def test_decode_mux_rejects(data: bytes) -> None:
    with pytest.raises(ProtocolError):
        list(decode_mux(data))


def test_decode_mux_of_no_frames() -> None:
    assert list(decode_mux(msgpack.packb([VERSION, Kind.MUX]))) == []


def test_decode_mux_yields_frames_in_order() -> None:
    data = msgpack.packb([1, 8, "r2", b"two", "r1", b"one", "r2", b""], use_bin_type=True)
    assert list(decode_mux(data)) == [("r2", b"two"), ("r1", b"one"), ("r2", b"")]



def test_batch_limit_stays_under_the_servers_max_payload() -> None:
    assert batch_limit(128 << 10, 1 << 20) == 128 << 10  # the configured bound
    # A small server limit: "uses that less 1 KiB" (docs/configuration.md).
    assert batch_limit(128 << 10, 65_536) == 64_512
    assert batch_limit(128 << 10, 100) == 1  # absurd server limit: one frame per batch
