"""What the edge does with each worker's Head (edge.relay.Relay._on_head), unit,
no socket: the decision table of a stream's takeovers.

| Head | before it | the edge |
| --- | --- | --- |
| the same one again | streaming | nothing (a resend) |
| an earlier delivery's, late | streaming | counts it stale, cancels that copy |
| another worker's | its worker alive | cancels the copy, keeps its worker |
| attempt 2, first of the relay | nothing | the go-ahead |
| another worker's | worker gone, no output | the go-ahead |
| another worker's | worker gone, output, text kept | ``Continue`` with that text |
| another worker's | worker gone, output, resumable | ``Continue`` to the log, client to resume |
| another worker's | worker gone, output, nothing kept | ``worker_lost`` |
| any worker's | its live worker gave the slot away | ``Continue`` with the text |

The pipeline tests (test_failover, test_continuation_apis) see the same
through real processes; these see it where mutation testing can
(docs/testing.md).
"""

from __future__ import annotations

import dataclasses
import json

import pytest
from aiohttp.test_utils import make_mocked_request

from edge.continuation import worker_gone
from edge.endings import Reconnect
from edge.relay import Relay, RelayContext
from edge.session import Session
from edge.sse_writer import SseWriter
from edge.stream import Phase
from tests.test_relay_direct import RecordingPublisher, make_request
from tidegate.config import Config, ModelConfig
from tidegate.errors import ApiError
from tidegate.wire.flow import first_seq
from tidegate.wire.protocol import (
    DUPLICATE_DELIVERY,
    Ack,
    Admission,
    Cancel,
    Continue,
    ControlMessage,
    Head,
    Status,
    decode_control,
)

W1, W2 = "tg.ctl.w1", "tg.ctl.w2"
JOB_ACK = "$JS.ACK.TG_JOBS.fake.1.5.5.0.0"


class Watch:
    """The edge's WorkerWatch: follows, and tells the relay nothing itself
    (a test calls ``worker_gone`` as the probe would)."""

    enabled = True

    def __init__(self) -> None:
        self.followed: list[str] = []

    def follow(self, follower: object, control: str) -> None:
        self.followed.append(control)

    def unfollow(self, follower: object, control: str) -> None:
        return None


def chunk(text: str) -> bytes:
    event = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "model": "fake",
             "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]}
    return b"data: " + json.dumps(event).encode() + b"\n\n"


def relay(publisher: RecordingPublisher, *, failover: str = "continue", stream: bool = True,
          resumable: bool = False) -> Relay:
    request = dataclasses.replace(make_request("r1", stream=stream), resumable=resumable)
    config = Config()
    model = ModelConfig(name="fake", failover=failover)  # type: ignore[arg-type]
    out = SseWriter(make_mocked_request("POST", "/v1/chat/completions"), request, {}, config)
    ctx = RelayContext(config, publisher, watch=Watch(),  # type: ignore[arg-type]
                       models={"fake": model})
    return Relay(out, Session("r1", 0.1), request, ctx, {})


def sent(publisher: RecordingPublisher) -> list[tuple[str, ControlMessage | bytes]]:
    out: list[tuple[str, ControlMessage | bytes]] = []
    for subject, payload in publisher.published:
        out.append((subject, payload if subject.startswith("$JS.") else decode_control(payload)))
    publisher.published.clear()
    return out


async def streaming_on_w1(publisher: RecordingPublisher, r: Relay, *texts: str) -> None:
    """W1's Head, then ``texts`` written to the client as chunks."""
    await r._on_head(Head(1, W1, 7, 1, JOB_ACK))
    assert r.phase is Phase.STREAMING
    for text in texts:
        data = chunk(text)
        r.wrote_chunks = True
        if r.delivered is not None:
            r.delivered.add(data)
    publisher.published.clear()


def probe_off(r: Relay) -> None:
    watch = r.ctx.watch
    assert isinstance(watch, Watch)
    watch.enabled = False


async def dies(r: Relay, control: str = W1) -> None:
    """The edge's probe finds the worker at ``control`` gone, as
    tidegate.broker.liveness tells the session and then the relay."""
    r.session.worker_lost(control)
    await worker_gone(r, control, 0.0)


async def test_the_first_head_takes_the_stream_and_its_job_ack() -> None:
    publisher = RecordingPublisher()
    r = relay(publisher)
    await r._on_head(Head(1, W1, 7, 1, JOB_ACK))
    assert (r.phase, r.control, r.job_ack) == (Phase.STREAMING, W1, JOB_ACK)
    assert (r.floor_seq, r.expected_seq) == (1, 2)
    assert r.headers["x-tidegate-job-seq"] == "7"
    assert isinstance(r.ctx.watch, Watch)
    assert r.ctx.watch.followed == [W1]
    assert sent(publisher) == []  # a first delivery needs no go-ahead


async def test_a_head_whose_ack_is_no_jetstream_ack_leaves_nothing_to_hand_back() -> None:
    """A batch line's or a test's Head names no job to -NAK: after output
    the stream cannot be handed back, and ends at once."""
    publisher = RecordingPublisher()
    r = relay(publisher)
    await r._on_head(Head(1, W1, 0, 1, "_INBOX.x"))
    assert r.job_ack == ""
    assert "x-tidegate-job-seq" not in r.headers
    r.wrote_chunks = True
    r.delivered.add(chunk("Hel"))  # type: ignore[union-attr]
    with pytest.raises(ApiError) as err:
        await worker_gone(r, W1, 0.0)
    assert err.value.code == "worker_lost"


async def test_the_same_head_again_changes_nothing() -> None:
    publisher = RecordingPublisher()
    r = relay(publisher)
    await streaming_on_w1(publisher, r, "Hel")
    await r._on_head(Head(1, W1, 7, 1, JOB_ACK))
    assert sent(publisher) == []
    assert (r.control, r.expected_seq, r.stale) == (W1, 2, 0)


async def test_late_heads_of_an_earlier_delivery_are_counted_and_their_copies_cancelled(
) -> None:
    publisher = RecordingPublisher()
    r = relay(publisher)
    await r._on_head(Head(first_seq(2), W2, 7, 2, JOB_ACK))
    publisher.published.clear()
    await r._on_head(Head(1, W1, 7, 1))
    await r._on_head(Head(1, W1, 7, 1))
    assert r.stale == 2
    assert sent(publisher) == [(W1, Cancel("r1", DUPLICATE_DELIVERY))] * 2
    assert r.control == W2


async def test_another_workers_copy_is_cancelled_while_the_first_lives() -> None:
    publisher = RecordingPublisher()
    r = relay(publisher)
    await streaming_on_w1(publisher, r, "Hel")
    await r._on_head(Head(first_seq(2), W2, 7, 2, JOB_ACK))
    assert sent(publisher) == [(W2, Cancel("r1", DUPLICATE_DELIVERY))]
    assert (r.control, r.expected_seq) == (W1, 2)


@pytest.mark.parametrize("attempt", [2, 3])
async def test_a_redelivered_job_as_the_first_head_gets_the_go_ahead(attempt: int) -> None:
    """Its worker waits for the edge's word before it calls the backend."""
    publisher = RecordingPublisher()
    r = relay(publisher)
    await r._on_head(Head(first_seq(attempt), W2, 7, attempt, JOB_ACK))
    assert sent(publisher) == [(W2, Ack("r1", 0))]
    assert r.control == W2


async def test_a_dead_workers_job_before_output_restarts_on_the_next() -> None:
    publisher = RecordingPublisher()
    r = relay(publisher)
    await streaming_on_w1(publisher, r)
    await dies(r)
    assert sent(publisher) == [(W1, Cancel("r1", DUPLICATE_DELIVERY)), (JOB_ACK, b"-NAK")]
    await r._on_head(Head(first_seq(2), W2, 7, 2, JOB_ACK))
    assert sent(publisher) == [(W2, Ack("r1", 0))]
    assert (r.control, r.floor_seq, r.expected_seq) == (W2, first_seq(2), first_seq(2) + 1)


async def test_a_dead_workers_stream_continues_from_the_text_its_client_got() -> None:
    publisher = RecordingPublisher()
    r = relay(publisher)
    await streaming_on_w1(publisher, r, "Hel", "lo, ", "wor")
    r.acks.on_written(2, 10)  # written up to the dead worker's seq 2: the next starts afresh
    await dies(r)
    publisher.published.clear()
    await r._on_head(Head(first_seq(2), W2, 7, 2, JOB_ACK))
    assert sent(publisher) == [(W2, Continue("r1", "Hello, wor", 3, response_id="chatcmpl-1"))]
    assert r.control == W2
    assert (r.acks.written_seq, r.acks.unacked_bytes) == (0, 0)


async def test_a_dead_workers_resumable_stream_continues_in_its_log() -> None:
    """The next worker continues the text in the log; the client is sent
    to resume there (Reconnect) from the last event it got."""
    publisher = RecordingPublisher()
    r = relay(publisher, resumable=True)
    assert r.continues_in_log
    assert r.delivered is None
    await streaming_on_w1(publisher, r, "Hel")
    r.session.worker_lost(W1)
    r.handed_back = True  # as worker_gone leaves it (its log refill needs NATS)
    with pytest.raises(Reconnect):
        await r._on_head(Head(first_seq(2), W2, 7, 2, JOB_ACK))
    assert sent(publisher) == [(W2, Continue("r1", "", 0))]


@pytest.mark.parametrize("failover", ["restart", "off"])
async def test_output_that_cannot_be_continued_ends_with_worker_lost(failover: str) -> None:
    publisher = RecordingPublisher()
    r = relay(publisher, failover=failover)
    await streaming_on_w1(publisher, r, "Hel")
    with pytest.raises(ApiError) as err:
        await dies(r)  # at once, not when the next Head comes
    assert err.value.code == "worker_lost"
    assert sent(publisher) == []  # nothing handed back
    probe_off(r)  # or unseen: at the next Head
    with pytest.raises(ApiError) as err:
        await r._on_head(Head(first_seq(2), W2, 7, 2, JOB_ACK))
    assert err.value.code == "worker_lost"
    assert sent(publisher) == []  # the new worker gets no go-ahead


async def test_a_second_head_with_the_text_not_yet_handed_back_ends_with_worker_lost() -> None:
    """Text kept, but no death seen (no hand-back): the new Head is no
    continuation the edge asked for."""
    publisher = RecordingPublisher()
    r = relay(publisher)
    probe_off(r)  # nothing then tells a live worker from a dead one
    await streaming_on_w1(publisher, r, "Hel")
    with pytest.raises(ApiError) as err:
        await r._on_head(Head(first_seq(2), W2, 7, 2, JOB_ACK))
    assert err.value.code == "worker_lost"


@pytest.mark.parametrize(("failover", "kept"), [("continue", False), ("restart", False),
                                                ("off", True)])
async def test_a_collected_body_is_dropped_when_its_job_restarts(failover: str,
                                                                 kept: bool) -> None:
    """A non-streamed request's body is only collected, never sent: a
    restart drops it and the next worker's body is the answer; with
    failover off nothing restarts."""
    publisher = RecordingPublisher()
    r = relay(publisher, failover=failover, stream=False)
    await r._on_head(Head(1, W1, 7, 1, JOB_ACK))
    probe_off(r)
    r._collect(b'{"partial": ')
    publisher.published.clear()
    if kept:
        with pytest.raises(ApiError):
            await r._on_head(Head(first_seq(2), W2, 7, 2, JOB_ACK))
        assert r.body_parts == [b'{"partial": ']
        return
    await r._on_head(Head(first_seq(2), W2, 7, 2, JOB_ACK))
    assert (r.body_parts, r.body_size) == ([], 0)
    assert sent(publisher) == [(W2, Ack("r1", 0))]


@pytest.mark.parametrize("next_worker", [W1, W2])
async def test_a_stream_its_live_worker_gave_away_continues_on_the_next(
        next_worker: str) -> None:
    """Preempted for a heavier tier (workers.preemption): its worker, alive,
    says the stream waits again (a QUEUED status with its last seq) and NAKs
    the job. The next Head, of any worker, the same one too, gets a
    Continue with the delivered text, not a cancel as a duplicate."""
    publisher = RecordingPublisher()
    r = relay(publisher)
    await streaming_on_w1(publisher, r, "Hel", "lo")
    await r._handle([Status(Admission.QUEUED, seq=3)], 0.0)
    assert r.handed_back
    assert r.session.worker == "", "its worker lives, but is no longer this stream's"
    await r._on_head(Head(first_seq(2), next_worker, 7, 2, JOB_ACK))
    assert sent(publisher) == [(next_worker, Continue("r1", "Hello", 2,
                                                      response_id="chatcmpl-1"))]
    assert r.control == next_worker


async def test_a_dispatchers_or_an_earlier_attempts_queued_status_changes_nothing() -> None:
    publisher = RecordingPublisher()
    r = relay(publisher)
    await r._on_head(Head(first_seq(2), W1, 7, 2, JOB_ACK))
    r.wrote_chunks = True
    assert r.delivered is not None
    r.delivered.add(chunk("Hel"))
    publisher.published.clear()
    for status in (Status(Admission.ADMITTED), Status(Admission.QUEUED, seq=3)):
        await r._handle([status], 0.0)  # a dispatcher's, late; the first attempt's seqs
        assert not r.handed_back
        assert r.session.worker == W1
    await r._on_head(Head(first_seq(3), W2, 7, 3, JOB_ACK))
    assert sent(publisher) == [(W2, Cancel("r1", DUPLICATE_DELIVERY))], "W1 still streams"
