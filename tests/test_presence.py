"""Fast death detection (issue 25, item 1): a worker holds its presence
subject on two NATS connections, to two nodes where it knows two
(``tidegate.broker.liveness.Presence``), so one node's death leaves it a
subscriber and a prober may confirm "no responders" in 0.5 s instead of
riding out a reconnect for 1.5 s.

Real nats-server (and a real three-node cluster): a worker that loses one
connection is not taken for dead, one that loses both is; the short
confirmation applies only to a worker seen holding its presence, and not
right after the prober's own reconnect; the presence connection goes to
another node than the main one and moves off it when both meet there."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import nats
import pytest
from nats.aio.msg import Msg

from tests.pipeline import Pipeline
from tests.poll import eventually
from tests.servers import ServerHandle, start_nats_cluster
from tests.test_continuation import killed_then_whole, normalized, overrides, run
from tidegate.broker import liveness
from tidegate.broker.liveness import CONFIRM_AFTER, CONFIRM_PRESENT, Presence, WorkerWatch
from tidegate.config import NatsConfig
from tidegate.run.clusters import NatsCluster
from tidegate.wire.subjects import Subjects, presence_of


def test_presence_of_a_control_subject() -> None:
    assert presence_of("tg.ctl.w1") == "tg.live.w1"
    assert presence_of("acme.prod.ctl.w-2") == "acme.prod.live.w-2"
    for control in ("", "tg.ctl.any", "tg.out.w1", "ctl.w1", "tg.ctl."):
        assert presence_of(control) == "", control
    s = Subjects(prefix="tg")
    assert s.presence_of(s.control("w1")) == s.presence("w1") == "tg.live.w1"
    assert Subjects(prefix="xy").presence_of("tg.ctl.w1") == ""  # another prefix's


class _Client:
    def __init__(self) -> None:
        self.stats = {"reconnects": 0}


def test_the_short_confirmation_needs_presence_and_a_settled_link() -> None:
    client = _Client()
    watch = WorkerWatch(client, 0.25)  # type: ignore[arg-type]
    assert watch.confirmation(True, 100.0) == CONFIRM_PRESENT < CONFIRM_AFTER
    assert watch.confirmation(False, 100.0) == CONFIRM_AFTER  # only a control subject
    client.stats["reconnects"] = 1  # the prober's own link came back
    assert watch.confirmation(True, 200.0) == CONFIRM_AFTER
    assert watch.confirmation(True, 200.0 + liveness.SETTLE_AFTER_RECONNECT - 0.1) == \
        CONFIRM_AFTER
    assert watch.confirmation(True, 200.0 + liveness.SETTLE_AFTER_RECONNECT) == \
        CONFIRM_PRESENT
    # Never before the dead worker's pull requests expired (worker.fetch_timeout):
    # a job handed back earlier would go to one of them and wait out ack_wait.
    slow_pulls = WorkerWatch(_Client(), 0.25, pull_expiry=1.0)  # type: ignore[arg-type]
    assert slow_pulls.confirmation(True, 100.0) == 1.0 + liveness.PULL_MARGIN
    assert WorkerWatch(_Client(), 0.25, pull_expiry=0.4).confirmation(  # type: ignore[arg-type]
        True, 100.0) == CONFIRM_PRESENT


async def _ignore(msg: Msg) -> None:
    return None


async def test_one_lost_connection_is_no_death_and_two_are(nats_server: ServerHandle) -> None:
    """The worker's main connection closes (as when its node dies) while its
    presence connection lives: never declared dead. Then the presence
    connection closes too: declared dead."""
    edge = await nats.connect(nats_server.url)
    main = await nats.connect(nats_server.url)
    second = await nats.connect(nats_server.url)
    for nc in (main, second):
        await nc.subscribe("tg.live.w1", cb=_ignore)
    await main.subscribe("tg.ctl.w1", cb=_ignore)
    for nc in (main, second):
        await nc.flush()
    lost: list[str] = []

    class Follower:
        def worker_lost(self, control: str) -> None:
            lost.append(control)

    watch = WorkerWatch(edge, 0.1)
    watch.follow(Follower(), "tg.ctl.w1")
    try:
        await asyncio.sleep(0.5)  # probes see its presence
        await main.close()
        await asyncio.sleep(4 * CONFIRM_PRESENT)
        assert not lost, "a worker that still holds its presence was declared dead"
        await second.close()
        await eventually(lambda: lost, 30, "the worker with no connection declared dead")
        assert lost == ["tg.ctl.w1"]
    finally:
        watch.close()
        await edge.close()


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[NatsCluster]:
    c = start_nats_cluster(tmp_path / "cluster")
    try:
        yield c
    finally:
        c.stop()


def _url(nc: Any) -> str:
    return str(nc.connected_url.geturl()) if nc.connected_url is not None else ""


@pytest.mark.pipeline
async def test_presence_goes_to_another_node_and_leaves_one_it_comes_to_share(
        cluster: NatsCluster) -> None:
    """The presence connection connects to a node other than the main
    connection's; when the main one's node dies and it reconnects to the
    presence connection's node, the presence connection moves on. Through it
    all, an edge on the third node never takes the worker for dead."""
    a, b, c = cluster.urls
    presence = Presence(NatsConfig(url=cluster.url), "presence-test", "tg.live.w1", _ignore)
    moved = asyncio.Event()

    async def back() -> None:
        presence.on_link(True)
        moved.set()

    main = await nats.connect(servers=[a, b], dont_randomize=True, reconnect_time_wait=0.2,
                              reconnected_cb=back, max_reconnect_attempts=-1)
    await main.subscribe("tg.live.w1", cb=_ignore)
    edge = await nats.connect(c)
    lost: list[str] = []

    class Follower:
        def worker_lost(self, control: str) -> None:
            lost.append(control)

    watch = WorkerWatch(edge, 0.1)
    try:
        await presence.start(main, asyncio.Event())
        assert presence.nc is not None
        assert _url(presence.nc) not in ("", _url(main)), (_url(presence.nc), _url(main))
        watch.follow(Follower(), "tg.ctl.w1")
        await asyncio.sleep(0.5)
        node = next(n for n in cluster.nodes if n.url == _url(main))
        node.kill()
        await asyncio.wait_for(moved.wait(), 60)  # the main connection is back
        await eventually(lambda: _url(presence.nc) not in ("", _url(main)), 60,
                         "the two connections on two nodes again")
        await asyncio.sleep(4 * CONFIRM_PRESENT)
        assert not lost, "a worker was declared dead through one node's death"
    finally:
        watch.close()
        await presence.close()
        await main.close()
        await edge.close()


@pytest.fixture
def slow_pulls(tmp_path: Path, nats_server: ServerHandle,
               redis_server: ServerHandle) -> Iterator[Pipeline]:
    """Two workers whose pull requests live 3 s (worker.fetch_timeout) and a
    redelivery only after 60 s (worker.ack_wait; the lost-worker limit
    above it): a job handed back to a dead worker's still registered pull
    request would pause its stream for a minute."""
    cfg = overrides(ack_wait=60.0)
    cfg["worker"]["fetch_timeout"] = 3.0
    cfg["session"]["worker_lost_after"] = 70
    p = Pipeline(tmp_path, nats_server.url, redis_server.url, workers=2, overrides=cfg)
    try:
        p.start()
        yield p
    finally:
        p.stop()


@pytest.mark.slow
@pytest.mark.pipeline
async def test_a_death_is_acted_on_after_the_dead_workers_pull_requests_expired(
        slow_pulls: Pipeline) -> None:
    """A worker SIGKILLed mid-stream under 12 streams, its pull requests
    still registered on the server for up to 3 s: the edges hand its jobs
    back only once those expired, so each goes to the live worker and every
    stream completes byte-exact, its pause seconds long. Handed back at once
    (0.75 s), a job could go to a dead request and wait for the 60 s of
    worker.ack_wait (the bound below is two thirds of that: a loaded box's
    few seconds are far from it)."""
    texts = [f"pulls-{i}-{uuid.uuid4().hex}" for i in range(12)]
    got, whole = await killed_then_whole(slow_pulls, lambda session, out: [
        run(session, slow_pulls.url, t, out) for t in texts])
    assert "continued on another worker" in slow_pulls.logs()
    for t in texts:
        raw, _ = got[t]
        assert raw.endswith(b"data: [DONE]\n\n"), raw[-300:]
        assert normalized(raw) == normalized(whole[t][0]), t
    pauses = sorted(got[t][1] for t in texts)
    assert pauses[-1] < 40.0, pauses
