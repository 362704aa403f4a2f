"""Worker presence and the liveness probe's confirmation (issue 25).

A worker's presence subject (``<p>.live.<worker>``) is where a redelivered
job no edge speaks for asks it whether it still runs the job
(``tidegate.broker.liveness.runs``); ``Subjects.presence_of`` names it from a Head's
control subject. A death is confirmed no sooner than the dead worker's pull
requests have expired (``worker.fetch_timeout``): a job handed back before
then goes to one of them and waits out ``worker.ack_wait``.

Unit, and a pipeline on a real nats-server and redis-server."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.pipeline import Pipeline
from tests.servers import ServerHandle
from tests.test_continuation import killed_then_whole, normalized, overrides, run
from tidegate.broker import liveness
from tidegate.broker.liveness import CONFIRM_AFTER, WorkerWatch
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
    assert WorkerWatch(None, 0.25, pull_expiry=1.0).confirmation == \
        CONFIRM_AFTER  # type: ignore[arg-type]
    long_pulls = WorkerWatch(None, 0.25, pull_expiry=3.0)  # type: ignore[arg-type]
    assert long_pulls.confirmation == 3.0 + liveness.PULL_MARGIN


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
