"""A second delivery of a job to the same live worker (unit, no socket).

JetStream delivers a job again when its acks were lost (a NATS node's
death). On another worker while the first lives, the edge cancels the copy
(tests/test_failover.py). On the *same* worker, the copy runs only because
the first one has ended there; after output, what that first copy sent last
was lost in transit with the acks, and the worker's tail still holds it: the
edge drops the copy and asks for the rest, instead of ending the stream with
``worker_lost`` (seen in ``tidegate chaos``: a stream that began 0.2 s
before a NATS node died)."""

from __future__ import annotations

from aiohttp.test_utils import make_mocked_request

from edge.relay import Relay, RelayContext
from edge.session import Session
from edge.sse_writer import SseWriter
from edge.stream import Phase
from tests.test_relay_direct import RecordingPublisher, make_request
from tidegate.config import Config
from tidegate.wire.protocol import DUPLICATE_DELIVERY, Ack, Cancel, Head, Retransmit, decode_control

WORKER = "tg.ctl.w1"


class Watch:
    """The edge's WorkerWatch, following and never finding a death."""

    enabled = True

    def follow(self, follower: object, control: str) -> None:
        return None

    def unfollow(self, follower: object, control: str) -> None:
        return None


def streaming(publisher: RecordingPublisher) -> Relay:
    request = make_request("r1")
    headers: dict[str, str] = {}
    out = SseWriter(make_mocked_request("POST", "/v1/chat/completions"), request, headers,
                    Config())
    relay = Relay(out, Session("r1", 0.1), request,
                  RelayContext(Config(), publisher, watch=Watch()),  # type: ignore[arg-type]
                  headers)
    return relay


async def test_a_copy_on_the_same_worker_after_output_asks_for_the_rest() -> None:
    publisher = RecordingPublisher()
    relay = streaming(publisher)
    await relay._on_head(Head(1, WORKER, 7, 1, "$JS.ACK.a.1"))
    assert relay.phase is Phase.STREAMING
    relay.wrote_chunks, relay.expected_seq = True, 12  # output up to seq 11
    publisher.published.clear()
    await relay._on_head(Head(1, WORKER, 7, 2, "$JS.ACK.a.2"))  # the copy, here again
    sent = [(subject, decode_control(payload)) for subject, payload in publisher.published]
    assert sent == [(WORKER, Cancel("r1", DUPLICATE_DELIVERY)), (WORKER, Retransmit("r1", 12))]
    assert relay.phase is Phase.STREAMING
    assert relay.control == WORKER


async def test_a_copy_on_the_same_worker_before_output_runs() -> None:
    """Nothing reached the client: the copy simply runs (a restart)."""
    publisher = RecordingPublisher()
    relay = streaming(publisher)
    await relay._on_head(Head(1, WORKER, 7, 1, "$JS.ACK.a.1"))
    publisher.published.clear()
    await relay._on_head(Head(1, WORKER, 7, 2, "$JS.ACK.a.2"))
    sent = [(subject, decode_control(payload)) for subject, payload in publisher.published]
    assert sent == [(WORKER, Ack("r1", 0))]
