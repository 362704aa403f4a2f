"""A resumable stream's log holds every event its client got, even when the
worker dies with the log behind the live path.

The worker stores its log one batch per JetStream round trip while the live
path runs ahead (workers.resumable), so at a SIGKILL the client may hold
events the log never got (CI: ``test_resume.py::test_worker_killed_mid_stream_
ends_with_retryable_error_and_log_keeps_output``, event 10 of 10 missing from
the replay). Once its edge takes the worker for dead, the edge stores what
the log lacks from what it relayed (``tidegate.wire.streamlog.LiveTail``):
here the worker's log is cut short by hand, against a real nats-server."""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import AsyncIterator

import pytest
from aiohttp.test_utils import make_mocked_request
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext

from edge.continuation import worker_gone
from edge.endings import worker_lost
from edge.logreader import StreamLog
from edge.relay import Relay, RelayContext
from edge.session import Session
from edge.sse_writer import SseWriter
from edge.state import NatsPublisher
from tests.pipeline import fresh_streams
from tests.poll import eventually
from tests.servers import ServerHandle
from tests.test_relay_copies import Watch
from tests.test_relay_direct import make_request
from tidegate import config as config_
from tidegate.config import Config
from tidegate.errors import ApiError
from tidegate.wire import streamlog
from tidegate.wire.protocol import Chunk, Head, Heartbeat
from tidegate.wire.streamlog import LiveTail, LogCursor, LogEvent, LogHandBack, LogOpen

WORKER = "ctl.w1"


def test_the_tail_gives_what_follows_the_logs_last_seq_without_a_gap() -> None:
    tail = LiveTail(size=4)
    for seq in range(2, 8):  # keeps 4..7
        tail.add(Chunk(seq, b"x") if seq != 5 else Heartbeat(seq))
    assert [m.seq for m in tail.after(4) or []] == [5, 6, 7]  # heartbeats take seqs too
    assert tail.after(7) == []  # the log has it all
    assert tail.after(9) == []  # ... or more (a copy that ran on)
    assert tail.after(2) is None  # seq 3 is no longer kept: a gap either way
    assert tail.after(0) is None  # the log lacks the Head
    # A later delivery's seqs (2**32 on) follow only its own Head, never the
    # first delivery's last seq.
    tail.add(Chunk((1 << 32) + 2, b"y"))
    assert [m.seq for m in tail.after(5) or []] == [6, 7]
    assert tail.after(7) is None


def test_the_last_seq_of_a_log_message() -> None:
    assert streamlog.last_seq([LogOpen("t", True, 1, 0, 0.0)]) == 0
    assert streamlog.last_seq([Head(1, WORKER, 1, 1, ""), Chunk(2, b"a"), Heartbeat(3)]) == 3
    assert streamlog.last_seq([LogHandBack(WORKER)]) == 0


@pytest.fixture
async def js_log(nats_server: ServerHandle) -> AsyncIterator[tuple[NATS, JetStreamContext, Config]]:
    async with fresh_streams(nats_server.url) as streams:
        yield streams


async def _read_log(js: JetStreamContext, config: Config, request_id: str) -> list[object]:
    """Every item of the log, as a reader from its start gets them."""
    stream = streamlog.stream_name(config.nats.subjects)
    info = await js.stream_info(stream)
    cursor = LogCursor()
    items: list[object] = []
    for seq in range(1, info.state.last_seq + 1):
        raw = await js.get_msg(stream, seq=seq)
        assert raw.subject == streamlog.subject(config.nats.subjects, request_id)
        for entry in streamlog.decode_entry(raw.data or b""):
            items += cursor.feed(entry)
    return items


class Unwritten(SseWriter):
    """No socket here: what the client got is what the relay handled."""

    async def write(self, data: bytes, *, last: bool = False) -> None:
        return None


def _event(n: int) -> bytes:
    return b'data: {"n": %d}\n\n' % n


@pytest.mark.parametrize("failover", ["continue", "off"])
async def test_a_dead_workers_log_gets_what_its_client_got(
        js_log: tuple[NATS, JetStreamContext, Config], failover: str) -> None:
    nc, js, base = js_log
    config = config_.from_dict({"nats": {"subject_prefix": base.nats.subjects.prefix},
                                "models": [{"name": "fake", "backend": "simulator",
                                            "failover": failover}]})
    request_id = uuid.uuid4().hex[:24]
    request = dataclasses.replace(make_request(request_id), resumable=True)
    subject = streamlog.subject(config.nats.subjects, request_id)
    # The log as the dying worker left it: its Head and events 1..4 stored;
    # it had sent 1..9 and a heartbeat live.
    head = Head(1, WORKER, 7, 1, "$JS.ACK.jobs.1")
    live = [Chunk(seq, _event(seq - 1)) for seq in range(2, 7)] + [Heartbeat(7)] + \
        [Chunk(seq, _event(seq - 2)) for seq in range(8, 12)]
    await js.publish(subject, LogOpen("t", True, 1, 0, 0.0).encode())
    await js.publish(subject, streamlog.batch(request_id, [head.encode()] +
                                              [m.encode() for m in live[:4]]))
    headers: dict[str, str] = {}
    out = Unwritten(make_mocked_request("POST", "/v1/chat/completions"), request, headers,
                    config)
    relay = Relay(out, Session(request_id, 0.1), request,
                  RelayContext(config, NatsPublisher(nc, config.nats.subjects), watch=Watch(),
                               models=config.model_index(),
                               streamlog=StreamLog(nc, js, config)),  # type: ignore[arg-type]
                  headers)
    relay.raw = lambda data, now: True  # the direct path's write, as a roomy socket's
    await relay._on_head(head)
    assert not await relay._handle(live[:5], 0.0)
    for chunk in live[5:]:  # the steady state's direct path keeps its chunks too
        if isinstance(chunk, Heartbeat) or not relay._direct(chunk):
            assert not await relay._handle([chunk], 0.0)
    assert relay.wrote_chunks
    if failover == "off":  # the stream ends: no hand-back
        with pytest.raises(ApiError) as ended:
            await worker_gone(relay, WORKER, 0.0)
        assert ended.value.code == worker_lost().code
    else:
        await worker_gone(relay, WORKER, 0.0)
        assert relay.handed_back
        # The hand-back follows the refill (stored, acked, before the hand-back
        # is sent): the next worker continues it all.
        async def handed_back() -> bool:
            last = await js.get_last_msg(streamlog.stream_name(config.nats.subjects), subject)
            return streamlog.decode_entry(last.data or b"") == [LogHandBack(WORKER)]
        await eventually(handed_back, 10, "the hand-back stored after the refill")
    items = await _read_log(js, config, request_id)
    # Events 1..9 once each, in order, the refill's included; then no end
    # (the next worker's, or the readers' silence limit).
    assert items == [LogEvent(n, _event(n)) for n in range(1, 10)]
    # Told twice (the silence limit after worker_gone), the log is filled once.
    before = (await js.stream_info(streamlog.stream_name(config.nats.subjects))).state.messages
    await relay.refill_log()
    after = (await js.stream_info(streamlog.stream_name(config.nats.subjects))).state.messages
    assert after == before

