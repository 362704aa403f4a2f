"""workers.preemption's choices and a preempted job's hand-back, on the
resumable job's fakes (tests/test_resumable_rules.py). The pipeline test is
tests/test_preemption.py."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from types import SimpleNamespace
from typing import Any

import pytest

from tests.poll import eventually
from tests.test_job_unit import REPLY, FakeBackend, FakeMsg, FakeNats, FakeStream, events, kinds
from tests.test_resumable_rules import CHAT_BODY, OWN, QUIET, configured, rig, running
from tidegate import config as tgconfig
from tidegate.wire import classes, streamlog
from tidegate.wire.protocol import Admission, Api, Head, Request, Status
from workers.job import Job
from workers.job_context import JobContext
from workers.job_state import PREEMPTED
from workers.preemption import Preemptions

BACKGROUND = {"background": True}
RESPONSES_BODY: dict[str, Any] = {"model": "m", "input": "hi", "max_output_tokens": 50}


class Waiting:
    """The jobs stream's consumer as consumer_info answers it."""

    def __init__(self, pending: int) -> None:
        self.pending = pending

    async def consumer_info(self, stream: str, consumer: str) -> Any:
        return SimpleNamespace(num_pending=self.pending, num_ack_pending=1)


def preemptions(rigged: Any, pending: int = 1) -> Preemptions:
    p = Preemptions(rigged.job.ctx)
    p.ctx = SimpleNamespace(config=rigged.job.ctx.config, nc=rigged.nc,  # type: ignore[assignment]
                            jetstream=lambda: Waiting(pending))
    return p


def background(**kwargs: Any) -> Any:
    return rig(api=Api.RESPONSES, body=dict(RESPONSES_BODY), extra=BACKGROUND, **kwargs)


def _off() -> Any:
    model = QUIET.models[0]
    queue = dataclasses.replace(model.queue, preempt_after=0.0)
    return dataclasses.replace(QUIET, models=(dataclasses.replace(model, queue=queue),))


@pytest.mark.parametrize(("case", "expected"), [
    ({}, True),
    ({"extra": {}}, False),  # a connection reads it: its client would see the seam
    ({"config": configured("restart")}, False),  # the model does not continue
    ({"delivered": 3}, False),  # handed back twice already (queue.max_preemptions)
    ({"delivered": 2}, True),
    ({"config": _off()}, False),  # queue.preempt_after = 0
])
async def test_what_may_be_preempted(case: dict[str, Any], expected: bool) -> None:
    kwargs = {"api": Api.RESPONSES, "body": RESPONSES_BODY, "extra": BACKGROUND, **case}
    r = rig(**kwargs)
    assert preemptions(r).preemptible(r.job) is expected


async def test_a_job_that_cannot_be_continued_is_not_preempted() -> None:
    r = background()
    r.job.request.body["tools"] = [{"type": "function", "name": "f"}]  # a half-written call
    assert not preemptions(r).preemptible(r.job)


async def test_the_job_with_the_least_output_goes_and_only_while_a_job_waits() -> None:
    first, second = background(), background()
    second.job.request = dataclasses.replace(second.job.request, id="r2")
    first.job.chunks_sent, second.job.chunks_sent = 9, 2
    cancelled: list[tuple[str, str]] = []
    for r in (first, second):
        r.job.cancel = (lambda reason, job=r.job:  # type: ignore[method-assign]
                        cancelled.append((job.request.id, reason)))
    idle = preemptions(first, pending=0)
    idle.held["m"] = {first.job, second.job}
    assert await idle.preempt("m") is None  # the interactive request found a slot
    p = preemptions(first)
    p.held["m"] = {first.job, second.job}
    assert await p.preempt("m") is second.job
    assert cancelled == [("r2", PREEMPTED)]
    assert p.held["m"] == {first.job}
    assert await p.preempt("other") is None


async def test_a_preempted_job_stores_its_log_hands_back_and_is_requeued() -> None:
    r = background(stream=FakeStream(events(5), hang=True))
    async with running(r) as task:
        await r.changes.until(lambda: r.job.chunks_sent >= 5)
        r.job.cancel(PREEMPTED)
        await task
    assert r.msg.fate[-1] == "nak", r.msg.fate
    assert "ack" not in r.msg.fate
    assert r.backend.requests
    # Its hand-back names this worker, stored after every chunk the log got.
    stored = [(subject, streamlog.decode_entry(payload)) for subject, payload, _ in r.nc.stored]
    assert stored[-1] == (r.job._log_subject, [streamlog.LogHandBack(OWN, True)]), stored
    assert r.log.kinds().count("Chunk") == 5
    assert not {"Error", "Done"} & set(r.log.kinds())


def test_only_a_preempted_hand_back_makes_readers_wait_for_the_next_worker() -> None:
    """An edge's hand-back of a dead worker leaves readers on the usual
    silence limit (its next copy may find it cannot continue: worker_lost);
    a preempting worker's makes them wait as a new request does."""
    for preempted in (False, True):
        entry = streamlog.LogHandBack(OWN, preempted)
        decoded = streamlog.decode_entry(entry.encode())
        assert decoded == [entry]
        cursor = streamlog.LogCursor()
        cursor.feed(Head(1, OWN, 7, 1, "$JS.ACK.x"))
        cursor.feed(decoded[0])
        assert cursor.requeued is preempted


# -- batch lines: nothing delivered before their end, so they run anew -----------------


def batch_line(delivered: int = 1, **fields: Any) -> tuple[Job, FakeMsg, FakeNats]:
    now_ms = int(time.time() * 1000)
    request = Request(**{  # type: ignore[arg-type]
        "id": "b1", "reply": REPLY, "model": "m", "api": Api.CHAT, "stream": False,
        "body": dict(CHAT_BODY), "created_ms": now_ms, "deadline_ms": now_ms + 600_000,
        "window_bytes": 1 << 20, "window_msgs": 128, "klass": classes.BATCH, **fields})
    msg, nc = FakeMsg(delivered=delivered), FakeNats()
    ctx = JobContext(config=configured("restart"), nc=nc, control_subject=OWN)  # type: ignore[arg-type]
    return Job(msg, request, FakeBackend(FakeStream(events(3), hang=True)), ctx), msg, nc  # type: ignore[arg-type]


@pytest.mark.parametrize(("case", "expected"), [
    ({}, True),  # whatever the model's failover: it restarts, nothing was delivered
    ({"delivered": 3}, False),  # handed back twice already
    ({"stream": True}, False),
    ({"klass": classes.INTERACTIVE}, False),
    ({"klass": classes.BACKGROUND}, False),  # continued from its log, when resumable
])
def test_what_batch_line_may_be_preempted(case: dict[str, Any], expected: bool) -> None:
    job, _, _ = batch_line(**case)
    assert Preemptions(job.ctx).preemptible(job) is expected


async def test_a_batch_line_goes_before_a_background_response() -> None:
    line, _, _ = batch_line()
    response = background()
    response.job.chunks_sent = 0
    cancelled: list[str] = []
    for job in (line, response.job):
        job.cancel = lambda reason, job=job: cancelled.append(job.request.id)  # type: ignore[method-assign]
    p = preemptions(response)
    p.held["m"] = {line, response.job}
    assert await p.preempt("m") is line, "the lowest class first"
    assert await p.preempt("m") is response.job
    assert cancelled == ["b1", "r1"]


# -- streams of a lighter tier: their edge continues them from the delivered text -------

TIERED = tgconfig.from_dict({
    "session": {"heartbeat_interval": 30, "ack_timeout": 600},
    "worker": {"ack_wait": 30},
    "models": [{"name": "m", "simulator": {}}],
    "tiers": [{"name": "gold", "weight": 4, "tenants": ["vip"]}]})


def tier_stream(weight: float | None = None, config: tgconfig.Config = TIERED,
                **fields: Any) -> tuple[Job, FakeMsg, FakeNats]:
    now_ms = int(time.time() * 1000)
    request = Request(**{  # type: ignore[arg-type]
        "id": "s1", "reply": REPLY, "model": "m", "api": Api.CHAT, "stream": True,
        "body": dict(CHAT_BODY), "created_ms": now_ms, "deadline_ms": now_ms + 600_000,
        "window_bytes": 1 << 20, "window_msgs": 128, **fields})
    msg, nc = FakeMsg(), FakeNats()
    if weight is not None:
        msg.headers[classes.WEIGHT_HEADER] = repr(weight)
    ctx = JobContext(config=config, nc=nc, control_subject=OWN)  # type: ignore[arg-type]
    return Job(msg, request, FakeBackend(FakeStream(events(3), hang=True)), ctx), msg, nc  # type: ignore[arg-type]


@pytest.mark.parametrize(("weight", "for_weight", "fields", "expected"), [
    (None, 4.0, {}, True),  # untiered (1) gives way to gold (4)
    (None, 1.0, {}, False),  # never to its own weight
    (4.0, 4.0, {}, False),
    (2.0, 4.0, {}, True),
    (None, 4.0, {"stream": False}, False),  # a body is only collected: nothing to continue
    (None, 4.0, {"klass": classes.BACKGROUND}, False),
    (None, 4.0, {"body": {**CHAT_BODY, "n": 2}}, False),  # not rebuildable from text
])
def test_which_stream_gives_way_to_a_heavier_tier(weight: float | None, for_weight: float,
                                                 fields: dict[str, Any],
                                                 expected: bool) -> None:
    job, _, _ = tier_stream(weight, **fields)
    assert Preemptions(job.ctx).preemptible(job, for_weight) is expected


def test_streams_are_held_only_where_a_heavier_tier_exists() -> None:
    held, _, _ = tier_stream()
    p = Preemptions(held.ctx)
    p._sync = lambda model: None  # type: ignore[method-assign]  # no NATS here
    p.started(held)
    assert p.held["m"] == {held}
    restart = dataclasses.replace(TIERED, models=(dataclasses.replace(
        TIERED.models[0], failover="restart"),))
    for config in (configured(), restart):  # no tier heavier than 1; not continued
        job, _, _ = tier_stream(config=config)
        q = Preemptions(job.ctx)
        q._sync = lambda model: None  # type: ignore[method-assign]
        q.started(job)
        assert q.held == {}


async def test_the_lightest_stream_gives_way_and_only_to_a_heavier_request() -> None:
    light, _, _ = tier_stream(0.5)
    plain, _, _ = tier_stream()
    plain.request = dataclasses.replace(plain.request, id="s2")
    cancelled: list[str] = []
    for job in (light, plain):
        job.cancel = lambda reason, job=job: cancelled.append(job.request.id)  # type: ignore[method-assign]
    p = Preemptions(light.ctx)
    p.ctx = SimpleNamespace(config=TIERED, nc=None,  # type: ignore[assignment]
                            jetstream=lambda: Waiting(1))
    p.held["m"] = {light, plain}
    assert await p.preempt("m", 0.5) is None, "no stream lighter than the asker"
    assert await p.preempt("m", 4.0) is light
    assert await p.preempt("m", 4.0) is plain
    assert cancelled == ["s1", "s2"]


@pytest.mark.parametrize("preempted", [batch_line, tier_stream])
async def test_a_preempted_job_says_it_waits_and_is_requeued(preempted: Any) -> None:
    """A batch line's runner or a stream's edge hears it waits again: a
    QUEUED status with the job's last seq (a dispatcher's has 0). Its
    message is NAKed; no usage record (its next copy reports it)."""
    job, msg, nc = preempted()
    task = asyncio.create_task(job.run())
    await eventually(lambda: kinds(nc).count("Chunk") == 3, 5.0, "three chunks out")
    job.cancel(PREEMPTED)
    await asyncio.wait_for(task, 5)
    assert kinds(nc) == ["Head", "Chunk", "Chunk", "Chunk", "Status"]
    assert nc.session()[-1] == Status(Admission.QUEUED, seq=4)
    assert job.seq == 4
    assert msg.fate[-1] == "nak", msg.fate
    assert "ack" not in msg.fate
    assert nc.usage() == []
