"""Worker presence and the liveness probe's confirmation (issue 25).

A worker's presence subject (``<p>.live.<worker>``) is where a redelivered
job no edge speaks for asks it whether it still runs the job
(``tidegate.broker.liveness.runs``); ``Subjects.presence_of`` names it from a Head's
control subject. A death is confirmed no sooner than the dead worker's pull
requests have expired (``worker.fetch_timeout``): a job handed back before
then goes to one of them and waits out ``worker.ack_wait``.

Unit, and a pipeline on a real nats-server and redis-server."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from pathlib import Path

import nats.errors
import pytest

from tests.pipeline import Pipeline
from tests.servers import ServerHandle
from tests.test_continuation import killed_then_whole, normalized, overrides, run
from tidegate.broker import liveness
from tidegate.broker.liveness import CONFIRM_AFTER, WorkerWatch
from tidegate.config.sections import WorkerConfig
from tidegate.wire.subjects import Subjects


def test_presence_of_a_control_subject() -> None:
    assert Subjects(prefix="acme").presence_of("acme.ctl.w-2") == "acme.live.w-2"
    for control in ("", "tg.ctl.any", "tg.out.w1", "ctl.w1", "tg.ctl."):
        assert Subjects(prefix="tg").presence_of(control) == "", control
    s = Subjects(prefix="tg")
    assert s.presence_of(s.control("w1")) == s.presence("w1") == "tg.live.w1"
    assert Subjects(prefix="xy").presence_of("tg.ctl.w1") == ""  # another prefix's


def test_the_confirmation_outlasts_the_workers_pull_requests() -> None:
    assert WorkerWatch(None, 0.25).confirmation == CONFIRM_AFTER  # type: ignore[arg-type]
    # The documented figure (docs/configuration.md, session.liveness_interval):
    # a longer one delays every death's news (tests/test_failover.py measures it).
    assert CONFIRM_AFTER == 0.6
    # The default pull expiry (worker.fetch_timeout, 0.5 s) does not bind.
    default = WorkerConfig().fetch_timeout
    assert default + liveness.PULL_MARGIN <= CONFIRM_AFTER
    assert WorkerWatch(None, 0.25, pull_expiry=default).confirmation == \
        CONFIRM_AFTER  # type: ignore[arg-type]
    long_pulls = WorkerWatch(None, 0.25, pull_expiry=3.0)  # type: ignore[arg-type]
    assert long_pulls.confirmation == 3.0 + liveness.PULL_MARGIN


class _Gone:
    """A NATS client to which every probed worker is gone: "no responders"."""

    async def request(self, subject: str, payload: bytes,
                      timeout: float) -> None:  # noqa: ASYNC109 (nats.aio.client.Client.request)
        raise nats.errors.NoRespondersError


async def test_a_death_is_declared_when_the_confirmation_ends_on_a_late_loop(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A busy event loop wakes every probe 40 ms late. The death is still
    declared when the confirmation ends, not at the first probe after it (a
    whole interval later: deaths known after 1.0 s instead of 0.8 s at 30
    streams). A virtual clock: nothing here depends on the machine's speed."""
    clock = [0.0]
    real_sleep = asyncio.sleep

    async def late_sleep(seconds: float) -> None:
        clock[0] += seconds + 0.04
        await real_sleep(0)

    monkeypatch.setattr(liveness.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(liveness.asyncio, "sleep", late_sleep)
    declared: list[float] = []

    class Follower:
        def worker_lost(self, control: str) -> None:
            declared.append(clock[0])

    watch = WorkerWatch(_Gone(), 0.25)  # type: ignore[arg-type]
    watch.follow(Follower(), "tg.ctl.w1")
    for _ in range(100):
        if declared:
            break
        await real_sleep(0)
    watch.close()
    # The first probe found nobody at 0; the confirmation ends at 0.6, and
    # the probe due then wakes 40 ms late (not at 0.87, three late intervals).
    assert declared == [pytest.approx(CONFIRM_AFTER + 0.04)]


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
    assert "continued on another worker" in slow_pulls.log_text()
    for t in texts:
        raw, _ = got[t]
        assert raw.endswith(b"data: [DONE]\n\n"), raw[-300:]
        assert normalized(raw) == normalized(whole[t][0]), t
    pauses = sorted(got[t][1] for t in texts)
    assert pauses[-1] < 40.0, pauses
