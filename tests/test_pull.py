"""tidegate.broker.pull on a real nats-server: what a stopping puller gives back.

A stopped puller's pull requests stay open at the server until they expire; a
message delivered into its inbox after it stopped reading would sit unacked
for the consumer's whole ack_wait before another puller saw it (the drain
test's "redelivered, not drained"). The consumer here has a 300 s ack_wait, so
"given back" and "waited out" cannot be confused on a loaded machine.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import nats
import pytest
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig

from tests.poll import eventually
from tests.servers import ServerHandle
from tidegate.broker.pull import Puller

STREAM, CONSUMER, SUBJECT = "PULLTEST", "work", "pulltest.jobs"


@pytest.fixture
async def nc(nats_server: ServerHandle) -> AsyncIterator[NATS]:
    client = await nats.connect(nats_server.url)
    js = client.jetstream()
    await js.add_stream(name=STREAM, subjects=[SUBJECT])
    await js.add_consumer(STREAM, ConsumerConfig(durable_name=CONSUMER, ack_wait=300,
                                                 ack_policy=AckPolicy.EXPLICIT))
    try:
        yield client
    finally:
        await client.close()


async def _waiting(nc: NATS) -> int:
    return int((await nc.jetstream().consumer_info(STREAM, CONSUMER)).num_waiting or 0)


async def test_a_message_delivered_to_a_stopped_puller_goes_to_another_at_once(
        nc: NATS, nats_server: ServerHandle) -> None:
    """The stopped puller keeps its inbox while its request is open and NAKs
    what arrives: the live puller gets the message on its second delivery,
    not after ack_wait; the stopped puller's handler never runs."""
    stopped_got: list[Msg] = []
    live_got: list[Msg] = []

    async def stopped_handler(msg: Msg) -> None:
        stopped_got.append(msg)

    async def live_handler(msg: Msg) -> None:
        live_got.append(msg)
        await msg.ack()

    # A long expiry: the stopped puller's request outlives its stop.
    first = Puller(nc, STREAM, CONSUMER, stopped_handler, capacity=4, expires=5.0)
    stop_first = asyncio.Event()
    running = asyncio.create_task(first.run(stop_first))
    await eventually(lambda: _waiting(nc), 30, "the first puller's request at the server")
    stop_first.set()
    await asyncio.sleep(0)  # run() sees its stop before anything arrives
    # The live puller asks only now, so the server's oldest request (the
    # stopped puller's) is served first.
    other = await nats.connect(nats_server.url)
    stop_live = asyncio.Event()
    live = Puller(other, STREAM, CONSUMER, live_handler, capacity=4, expires=5.0)
    live_task = asyncio.create_task(live.run(stop_live))
    try:
        async def both() -> bool:
            return await _waiting(nc) >= 2

        await eventually(both, 30, "both requests at the server")
        await nc.jetstream().publish(SUBJECT, b"job")
        await eventually(lambda: live_got, 120, "the message at the live puller")
        assert live_got[0].metadata.num_delivered == 2, "not the stopped puller's NAK"
        assert not stopped_got, "a stopped puller started a message"
        await asyncio.wait_for(running, 60)
        assert first.outstanding == 0
    finally:
        stop_live.set()
        await live_task
        await other.close()


async def test_a_stopped_puller_does_not_take_back_what_it_gave_back(
        nc: NATS, nats_server: ServerHandle) -> None:
    """Alone at the server, the stopped puller's open request would be the
    first to get its own NAKed message again (and again: each delivery counts
    to the consumer's max_deliver). The NAK's delay outlasts that request, so
    the message's next delivery is the next puller's."""
    async def never(msg: Msg) -> None:
        raise AssertionError("a stopped puller started a message")

    first = Puller(nc, STREAM, CONSUMER, never, capacity=4, expires=3.0)
    stop_first = asyncio.Event()
    running = asyncio.create_task(first.run(stop_first))
    await eventually(lambda: _waiting(nc), 30, "the first puller's request at the server")
    stop_first.set()
    await asyncio.sleep(0)
    await nc.jetstream().publish(SUBJECT, b"job")
    await asyncio.wait_for(running, 60)
    got: list[Msg] = []

    async def keep(msg: Msg) -> None:
        got.append(msg)
        await msg.ack()

    stop_live = asyncio.Event()
    live = Puller(nc, STREAM, CONSUMER, keep, capacity=1, expires=3.0)
    live_task = asyncio.create_task(live.run(stop_live))
    try:
        await eventually(lambda: got, 120, "the message at the next puller")
        assert got[0].metadata.num_delivered == 2, got[0].metadata
    finally:
        stop_live.set()
        await live_task
