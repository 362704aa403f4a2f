"""An earlier delivery's late output never becomes a later delivery's text
(flow.first_seq: each delivery numbers its messages in a range of its
own), unit, no servers.

The case: a worker cut from NATS keeps what it sends in its client's buffer;
the edge finds it gone before anything reached the client and the job runs
again elsewhere (``failover = "restart"``). At the heal the cut worker's
buffer flushes: its Head, chunks and Done, numbered from 1 as the new
delivery's were. Taken by seq alone they interleaved with the new
delivery's: a partition test once delivered 318 of 276 characters, 42 tokens
twice. The real worker job (workers/job.py) produces both deliveries' wire
messages here; the real relay (edge/relay.py) and log cursor
(tidegate/wire/streamlog.py) read them interleaved.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from aiohttp.test_utils import make_mocked_request

import edge.relay as relay_module
from edge.relay import Relay, RelayContext
from edge.session import Session
from edge.sse_writer import SseWriter
from tests.poll import eventually
from tests.test_job_unit import FakeBackend, FakeMsg, FakeStream, kinds, make_job
from tests.test_relay_copies import Watch
from tests.test_relay_direct import RecordingPublisher, make_request
from tidegate.config import Config
from tidegate.wire.flow import first_seq
from tidegate.wire.protocol import Chunk, Done, Head, decode_control
from tidegate.wire.streamlog import LogCursor, LogEvent


def text(name: str, n: int) -> list[bytes]:
    return [b'data: {"%s": %d}\n\n' % (name.encode(), i) for i in range(n)]


async def delivery(attempt: int, chunks: list[bytes]) -> list[Any]:
    """The wire messages a worker sends for the job's ``attempt``-th delivery
    (a redelivery runs on the edge's go-ahead, as workers/job.py waits for)."""
    job, _msg, nc = make_job(FakeBackend(FakeStream(chunks)), FakeMsg(delivered=attempt))
    task = asyncio.create_task(job.run())
    if attempt > 1:
        await eventually(lambda: kinds(nc) == ["Head"], 2.0, "the redelivery's Head")
        job.on_ack(0)
    await asyncio.wait_for(task, 5)
    return nc.session()


class Unwatched(Watch):
    """No WorkerWatch verdict: the first worker is not known alive, so the
    second delivery's Head takes the stream over (the restart)."""

    enabled = False


def collecting_relay(publisher: RecordingPublisher) -> Relay:
    """A non-streamed request's relay: what it takes is in ``body_parts``."""
    request = make_request("r1", stream=False)
    headers: dict[str, str] = {}
    out = SseWriter(make_mocked_request("POST", "/v1/chat/completions"), request, headers,
                    Config())
    return Relay(out, Session("r1", 0.1), request,
                 RelayContext(Config(), publisher, watch=Unwatched()),  # type: ignore[arg-type]
                 headers)


def interleaved(first: list[Any], second: list[Any]) -> list[Any]:
    """The first delivery's Head, then the second's Head, then the rest of
    both alternating, the first's late (a flushed buffer): the worst order."""
    out = [first[0], second[0]]
    a, b = first[1:], second[1:]
    for i in range(max(len(a), len(b))):
        out += a[i:i + 1] + b[i:i + 1]
    return out


async def test_a_restarted_streams_text_is_the_new_deliverys_only(
        monkeypatch: pytest.MonkeyPatch) -> None:
    drops: list[tuple[str, str, str]] = []

    class Counted:
        def drop(self, kind: str, reason: str, detail: str = "") -> None:
            drops.append((kind, reason, detail))
    monkeypatch.setattr(relay_module, "BAD_INPUT", Counted())
    first = await delivery(1, text("a", 6))
    second = await delivery(2, text("b", 6))
    publisher = RecordingPublisher()
    relay = collecting_relay(publisher)
    done = False
    for message in interleaved(first, second):
        done = await relay._handle([message], time.monotonic()) or done
        if done:
            break
    assert done
    assert b"".join(relay.body_parts) == b"".join(text("b", 6))
    second_head = second[0]
    assert isinstance(second_head, Head)
    assert second_head.seq == first_seq(2) > max(m.seq for m in first)
    # the first delivery's chunks and Done, none taken (its Head came first),
    # and counted where an operator sees them
    assert relay.stale == 7
    assert sum(int(detail.split(": ")[1].split()[0]) for kind, reason, detail in drops
               if reason == "earlier_delivery") == 7
    sent = [decode_control(p) for _, p in publisher.published]
    assert sent[0].seq == 0  # the go-ahead to the second delivery


async def test_a_late_head_of_an_earlier_delivery_is_ignored_and_its_copy_cancelled() -> None:
    publisher = RecordingPublisher()
    relay = collecting_relay(publisher)
    await relay._on_head(Head(first_seq(2), "tg.ctl.w2", 7, 2))
    publisher.published.clear()
    await relay._on_head(Head(1, "tg.ctl.w1", 7, 1))  # the cut worker's, flushed late
    assert relay.control == "tg.ctl.w2"
    assert relay.expected_seq == first_seq(2) + 1
    assert relay.stale == 1
    assert [subject for subject, _ in publisher.published] == ["tg.ctl.w1"]  # its Cancel


async def test_a_log_reader_skips_an_earlier_deliverys_late_entries() -> None:
    """The same in a resumable stream's log: the late entries, Head
    included, are skipped, never read as the text nor as a gap."""
    first = [Head(1, "tg.ctl.w1", 7, 1), Chunk(2, b'data: {"a": 0}\n\n'),
             Chunk(3, b'data: {"a": 1}\n\n'), Done(4, 1, 2, "stop")]
    base = first_seq(2)
    second = [Head(base, "tg.ctl.w2", 7, 2), Chunk(base + 1, b'data: {"b": 0}\n\n'),
              Chunk(base + 2, b'data: {"b": 1}\n\n'), Done(base + 3, 1, 2, "stop")]
    cursor = LogCursor()
    events: list[bytes] = []
    for entry in [second[0], first[0], first[1], second[1], first[2], first[3], second[2],
                  second[3]]:
        for item in cursor.feed(entry):  # type: ignore[arg-type]
            if isinstance(item, LogEvent):
                events.append(item.data)
    assert cursor.ended
    assert events == [b'data: {"b": 0}\n\n', b'data: {"b": 1}\n\n']


def test_the_first_delivery_costs_no_byte_more() -> None:
    """Delivery 1 numbers from 1 as before: the hot path's chunks keep their size."""
    assert first_seq(1) == 1
    assert first_seq(2) == 2**32 + 1
    assert first_seq(0) == 1
