"""The figures a worker's job hands on, to the unit (issue 42 item 3: each
test kills a survivor of workers/job.py that changes what a client, the
usage record, an operator's metrics or traces, or the broker sees).

On a clock the test moves (``workers.job.time``): the usage record's times
and the metrics made from them, exactly; the watchdog's wake-ups and the
in-progress acks' period (a ``sleep`` that waits for the test). On
test_job_unit's fakes: the record's money and reservation, the jobs, spend
and per-token metrics, the span (name, kind, parent, the context the backend
call carries), a refusal's seq and limiter sample, the Head's ack subject,
a retransmit of held messages, which path a message takes, a pushed
stream's stall counted once per full window, and a helper logged only
when it failed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from types import SimpleNamespace

import pytest
from opentelemetry.trace import SpanKind

import workers.job as job_module
from tests.poll import eventually
from tests.test_job_metrics import Observed
from tests.test_job_rules import PRICED, Limit, priced
from tests.test_job_rules_flow import Outbox, Push, muxed
from tests.test_job_unit import (
    FakeBackend,
    FakeMsg,
    FakeNats,
    FakeStream,
    events,
    kinds,
    make_job,
    start,
)
from tests.test_replica_continuation import BROKEN, Replica
from tidegate import config as tgconfig
from tidegate.control import prices
from tidegate.errors import BackendError
from tidegate.wire.protocol import Head, Heartbeat
from workers.backends import Usage
from workers.job import Job
from workers.job_state import ACK_TIMEOUT, WORKER_SHUTDOWN

# Timings no watchdog reaches while a test runs: heartbeats and the ack
# timeout are the clock's, which moves only when a test says so.
SLOW = tgconfig.from_dict({
    "session": {"heartbeat_interval": 100, "ack_timeout": 400, "worker_lost_after": 600},
    "worker": {"ack_wait": 30, "resume_timeout": 0.3},
})


class Clock:
    """``workers.job``'s ``time``: both clocks stand still until moved."""

    def __init__(self) -> None:
        self.now = 100.0  # monotonic
        self.wall = 2_000_000.0  # time.time(): a whole number of ms, exactly

    def monotonic(self) -> float:
        return self.now

    def time(self) -> float:
        return self.wall


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr(job_module, "time", clock)
    return clock


class Timed(FakeStream):
    """Moves the clock: to ``first`` with each chunk, to ``end`` at the end."""

    clock: Clock
    first: float
    end: float

    async def read(self, max_bytes: int) -> bytes:
        data = await super().read(max_bytes)
        self.clock.now = self.first if data else self.end
        return data


def timed_job(clock: Clock, stream: FakeStream, waited_ms: float,
              observed: Observed) -> tuple[Job, FakeNats]:
    """A job the edge accepted ``waited_ms`` before the worker made it."""
    backend = FakeBackend(stream)
    base, msg, nc = make_job(backend)
    request = dataclasses.replace(base.request, created_ms=int(clock.wall * 1000 - waited_ms))
    ctx = dataclasses.replace(base.ctx, config=SLOW, telemetry=observed.telemetry)
    return Job(msg, request, backend, ctx), nc  # type: ignore[arg-type]


# -- the usage record's times, and the metrics made from them ---------------------------


async def test_the_record_and_the_metrics_take_the_jobs_own_times(clock: Clock) -> None:
    """Made at 100 s, 1.5 s after the edge took the request; first chunk at
    102 s, the end at 110 s, 3 tokens: every figure follows exactly."""
    stream = Timed(events(3), usage=Usage(5, 0, "", 2))
    stream.clock, stream.first, stream.end = clock, 102.0, 110.0
    observed = Observed()
    job, nc = timed_job(clock, stream, 1500, observed)
    await asyncio.wait_for(job.run(), 10)
    [record] = nc.usage()
    assert (record.queue_wait_ms, record.ttft_ms, record.duration_ms) == (1500.0, 2000.0,
                                                                         10000.0)
    assert (record.finish_reason, record.cached_tokens) == ("stop", 2)
    figures = {name: observed.points(name) for name in (
        "tidegate.queue.wait", "gen_ai.server.time_to_first_token",
        "gen_ai.server.time_per_output_token", "gen_ai.server.request.duration",
        "tidegate.worker.jobs", "gen_ai.client.token.usage")}
    assert [p.sum for p in figures["tidegate.queue.wait"]] == [1.5]
    assert [p.sum for p in figures["gen_ai.server.time_to_first_token"]] == [3.5]
    assert [p.sum for p in figures["gen_ai.server.time_per_output_token"]] == [4.0]
    assert [p.sum for p in figures["gen_ai.server.request.duration"]] == [11.5]
    for name, points in figures.items():
        for point in points:
            assert point.attributes["gen_ai.operation.name"] == "chat", (name, point)
    [span] = observed.spans.get_finished_spans()
    assert (span.attributes or {})["gen_ai.response.finish_reasons"] == ("stop",)


async def test_a_request_stamped_after_the_workers_clock_waited_nothing(clock: Clock) -> None:
    observed = Observed()
    job, nc = timed_job(clock, FakeStream(events(1)), -5000, observed)
    await asyncio.wait_for(job.run(), 10)
    [record] = nc.usage()
    assert record.queue_wait_ms == 0.0
    [queued] = observed.points("tidegate.queue.wait")
    assert queued.sum == 0.0


async def test_a_job_admission_reserved_nothing_for_says_so_in_its_record() -> None:
    job, _, nc = make_job(FakeBackend(FakeStream(events(1))), FakeMsg(reserved=False))
    await asyncio.wait_for(job.run(), 5)
    [record] = nc.usage()
    assert record.reserved is False


async def test_a_job_handed_back_is_counted_once_without_a_record() -> None:
    observed = Observed()
    stream = FakeStream([], hang=True)
    job, msg, nc = make_job(FakeBackend(stream))
    job.ctx = dataclasses.replace(job.ctx, telemetry=observed.telemetry)
    task = await start(job)
    await eventually(lambda: job.stream is not None, 2.0, "the backend called")
    job.cancel(WORKER_SHUTDOWN)
    await asyncio.wait_for(task, 5)
    assert (msg.fate[-1], nc.usage()) == ("nak", [])
    [jobs] = observed.points("tidegate.worker.jobs")
    assert jobs.value == 1
    assert dict(jobs.attributes) == {"gen_ai.request.model": "m",
                                     "gen_ai.operation.name": "chat",
                                     "tidegate.outcome": "handed_back"}


# -- the time per output token: a done job of two tokens or more ------------------------


@pytest.mark.parametrize(("chunks", "fail", "samples"), [
    (2, None, 1), (1, None, 0), (2, BROKEN, 0)])
async def test_time_per_output_token_needs_a_done_job_and_two_tokens(
        chunks: int, fail: BackendError | None, samples: int) -> None:
    observed = Observed()
    nc = await observed.run(FakeBackend(FakeStream(events(chunks), fail=fail)))
    [record] = nc.usage()
    assert record.completion_tokens == chunks
    points = observed.points("gen_ai.server.time_per_output_token")
    assert sum(p.count for p in points) == samples, record.outcome


# -- money: the spend counter, and no currency without a price --------------------------


async def test_a_priced_job_adds_its_cost_to_the_spend_counter() -> None:
    observed = Observed()
    job, _, nc = priced(FakeStream(events(3), usage=Usage(1000, 0, "", 400)))
    job.ctx = dataclasses.replace(job.ctx, telemetry=observed.telemetry)
    await asyncio.wait_for(job.run(), 5)
    [record] = nc.usage()
    assert record.cost_nanos > 0
    [spend] = observed.points("tidegate.spend")
    assert spend.value == record.cost_nanos / prices.NANO
    assert dict(spend.attributes) == {"tidegate.tenant": "t", "gen_ai.request.model": "m",
                                      "tidegate.currency": "EUR"}


async def test_a_done_job_with_no_output_pays_its_request_in_the_record_too() -> None:
    job, _, nc = priced(FakeStream([], usage=Usage(10, 0, "")))
    await asyncio.wait_for(job.run(), 5)
    price = prices.PriceBook(PRICED).get("m")
    assert price is not None
    [record] = nc.usage()
    assert record.cost_nanos == price.cost(10, 0, 0) > 0


async def test_a_model_the_price_book_lacks_has_no_currency() -> None:
    job, _, nc = priced(FakeStream(events(1)))
    job.request = dataclasses.replace(job.request, model="unpriced")
    await asyncio.wait_for(job.run(), 5)
    [record] = nc.usage()
    assert (record.cost_nanos, record.currency) == (0, "")


async def test_the_backend_is_asked_with_the_price_a_client_opted_into() -> None:
    backend = Replica(FakeStream(events(1)))
    job, _, _ = make_job(backend)  # type: ignore[arg-type]
    job.ctx = dataclasses.replace(job.ctx, prices=prices.PriceBook(PRICED))
    job.request = dataclasses.replace(job.request, extra={prices.COST_OPT_IN: True})
    await asyncio.wait_for(job.run(), 5)
    [asked] = backend.requests
    price = prices.PriceBook(PRICED).get("m")
    assert price is not None
    assert asked.extra[prices.PRICE_EXTRA] == prices.price_spec(price, "EUR")
    assert asked.extra[prices.COST_OPT_IN] is True


# -- the job's span ---------------------------------------------------------------------

TRACE, PARENT = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
TRACEPARENT = f"00-{TRACE}-{PARENT}-01"


@pytest.mark.parametrize("carrier", ["headers", "request"])
async def test_the_span_continues_its_parent_and_the_backend_call_continues_it(
        carrier: str) -> None:
    """The parent comes from the NATS headers, else from the request; the
    backend's request carries this span as its parent."""
    observed = Observed()
    backend = Replica(FakeStream(events(1)))
    job, msg, _ = make_job(backend)  # type: ignore[arg-type]
    job.ctx = dataclasses.replace(job.ctx, telemetry=observed.telemetry)
    if carrier == "headers":
        msg.headers = {**msg.headers, "traceparent": TRACEPARENT}
        job.request = dataclasses.replace(job.request, extra={
            "traceparent": f"00-{'1' * 32}-{'2' * 16}-01"})  # the edge's, not the last hop's
    else:
        job.request = dataclasses.replace(job.request, extra={"traceparent": TRACEPARENT})
    await asyncio.wait_for(job.run(), 5)
    [span] = observed.spans.get_finished_spans()
    assert (span.name, span.kind) == ("chat m", SpanKind.CLIENT)
    assert span.parent is not None
    assert (f"{span.parent.trace_id:032x}", f"{span.parent.span_id:016x}") == (TRACE, PARENT)
    attrs = span.attributes or {}
    assert (attrs["tidegate.attempt"], attrs["gen_ai.operation.name"]) == (1, "chat")
    [asked] = backend.requests
    assert asked.extra["traceparent"] == (
        f"00-{TRACE}-{span.context.span_id:016x}-01"), "the backend call's parent is the job"


async def test_a_refused_job_marks_its_span_a_backend_error() -> None:
    observed = Observed()
    await observed.run(FakeBackend(refuse=BackendError(400, "no", type="invalid_request_error")))
    [span] = observed.spans.get_finished_spans()
    assert span.status.description == "backend_error"


# -- the adaptive limit given when the job is made ------------------------------------


async def test_a_limit_given_at_construction_gets_the_jobs_samples() -> None:
    base, msg, _ = make_job(FakeBackend(FakeStream(events(2))))
    limit = Limit()
    job = Job(msg, base.request, base.backend, base.ctx, limit)  # type: ignore[arg-type]
    await asyncio.wait_for(job.run(), 5)
    assert [c[0] for c in limit.calls] == ["mark", "ttfb", "mark", "tpot"]


async def test_a_refusal_has_the_next_seq_and_tells_the_limit_when(clock: Clock) -> None:
    job, _, nc = make_job(FakeBackend(refuse=BackendError(429, "slow down",
                                                          type="rate_limit_error")))
    limit = job.limit = Limit()  # type: ignore[assignment]
    clock.now = 123.0
    await asyncio.wait_for(job.run(), 5)
    assert [(type(m).__name__, m.seq) for m in nc.session()] == [("Head", 1), ("Error", 2)]
    assert limit.calls == [("mark", (123.0,), {}), ("overload", (123.0,), {})]


# -- the watchdog and the in-progress acks, step by step ------------------------------


class Sleeps:
    """``workers.job``'s ``asyncio`` with a ``sleep`` that records its delay
    and returns only when the test lets it (``step``)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.delays: list[float] = []
        self._go = asyncio.Semaphore(0)
        names = {n: getattr(asyncio, n) for n in dir(asyncio) if not n.startswith("__")}
        monkeypatch.setattr(job_module, "asyncio", SimpleNamespace(**{**names,
                                                                     "sleep": self.sleep}))

    async def sleep(self, delay: float) -> None:
        self.delays.append(delay)
        await self._go.acquire()

    async def step(self, woken: int) -> None:
        """Let one sleep return; wait until the sleeper sleeps again (or ends)."""
        self._go.release()
        await eventually(lambda: len(self.delays) > woken, 2.0, f"sleep {woken + 1}")


async def test_the_watchdog_wakes_for_the_next_heartbeat_or_a_quarter_ack_timeout(
        clock: Clock, monkeypatch: pytest.MonkeyPatch) -> None:
    """Heartbeat every 1 s, ack timeout 2 s (a tick of 0.5 s): it sleeps a
    tick, or until the heartbeat is due; past the ack timeout it cancels the
    job and stops, with nothing more sent."""
    sleeps = Sleeps(monkeypatch)
    job, _, nc = make_job(FakeBackend(FakeStream([])))
    job.ctx = dataclasses.replace(job.ctx, config=tgconfig.from_dict({
        "session": {"heartbeat_interval": 1.0, "ack_timeout": 2.0, "worker_lost_after": 60},
        "worker": {"ack_wait": 30, "resume_timeout": 0.3}}))
    job.last_sent = job.last_ack_at = clock.now
    running = job.task = asyncio.create_task(asyncio.Event().wait())  # the job's own task
    watchdog = asyncio.create_task(job._watchdog())
    await eventually(lambda: sleeps.delays, 2.0, "the watchdog sleeps")
    clock.now = 100.75
    await sleeps.step(1)  # nothing due: until the heartbeat, 0.25 s on
    clock.now = 101.0
    await sleeps.step(2)  # a heartbeat, then a whole tick
    assert sleeps.delays == [0.5, pytest.approx(0.25), 0.5]
    assert kinds(nc) == ["Heartbeat"]
    clock.now = 102.5
    sleeps._go.release()
    await asyncio.wait_for(watchdog, 5)
    assert (job.cancel_reason, len(sleeps.delays)) == (ACK_TIMEOUT, 3)
    assert [m.seq for m in nc.session() if isinstance(m, Heartbeat)] == [1], "nothing more"
    await asyncio.gather(running, return_exceptions=True)


async def test_in_progress_acks_come_every_third_of_ack_wait(
        monkeypatch: pytest.MonkeyPatch) -> None:
    sleeps = Sleeps(monkeypatch)
    job, msg, _ = make_job(FakeBackend(FakeStream([])))
    task = asyncio.create_task(job._keep_in_progress())
    await eventually(lambda: sleeps.delays, 2.0, "it sleeps")
    await sleeps.step(1)
    assert msg.fate == ["in_progress"]
    assert sleeps.delays == [job.ctx.config.worker.ack_wait / 3] * 2
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def test_a_helper_task_is_logged_only_when_it_failed(
        caplog: pytest.LogCaptureFixture) -> None:
    """Every job cancels its helpers at its end: that is no error."""

    async def fails() -> None:
        raise RuntimeError("lost")

    failed = job_module._helper(fails())
    stopped = job_module._helper(asyncio.Event().wait())  # type: ignore[arg-type]
    await eventually(failed.done, 2.0, "the helper failed")
    stopped.cancel()
    await asyncio.gather(failed, stopped, return_exceptions=True)
    await asyncio.sleep(0)  # the done callbacks
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert [(r.name, r.getMessage()) for r in errors] == [
        ("tidegate.worker", "job helper task failed")]
    assert errors[0].exc_info is not None
    assert isinstance(errors[0].exc_info[1], RuntimeError)


# -- a pushed stream: a stall counted once per full window ----------------------------


class Held(Push):
    """A Push that ends only when told, after its chunks ran out."""

    def resume(self) -> None:
        while self.chunks and self.sink.credit() > 0:
            self.sink.data(self.chunks.pop(0))
            self.usage.completion_tokens += 1

    def finish(self) -> None:
        self.usage.finish_reason = "stop"
        self.sink.end(None)


@pytest.mark.parametrize(("window", "chunks", "stalls"), [(2, 3, 1), (4, 1, 0)])
async def test_an_ack_of_an_open_window_counts_no_stall(window: int, chunks: int,
                                                        stalls: int) -> None:
    """Two acks while pushing: the first frees a full window (2 chunks of 3)
    or an open one (1 chunk of a window of 4); the second, an open one."""
    observed = Observed()
    stream = Held(events(chunks))
    job, msg, _ = make_job(FakeBackend(stream), window_msgs=window)  # type: ignore[arg-type]
    job.ctx = dataclasses.replace(job.ctx, telemetry=observed.telemetry)
    outbox = muxed(job)
    task = asyncio.create_task(job.run())
    first = 1 + min(window, chunks)
    await eventually(lambda: len(outbox.puts) == first, 2.0, "Head and the first chunks")
    job.on_ack(job.seq)
    await eventually(lambda: len(outbox.puts) == 1 + chunks, 2.0, "every chunk")
    job.on_ack(job.seq)
    stream.finish()
    await asyncio.wait_for(task, 5)
    points = observed.points("tidegate.flow.stall.duration")
    assert sum(p.count for p in points) == stalls
    assert sum(p.sum for p in points) == job.stall_time < 30
    assert msg.fate[-1] == "ack"


# -- what the edge is sent: the Head's ack subject, a retransmit, which path ----------


async def test_the_head_names_the_messages_ack_subject() -> None:
    job, msg, nc = make_job(FakeBackend(FakeStream(events(1))))
    await asyncio.wait_for(job.run(), 5)
    head = nc.session()[0]
    assert isinstance(head, Head)
    assert head.ack == msg.reply


async def test_a_retransmit_from_the_head_sends_the_head_again() -> None:
    job, _, nc = make_job(FakeBackend(FakeStream(events(1), hang=True)))
    task = await start(job)
    await eventually(lambda: "Chunk" in kinds(nc), 2.0, "a chunk out")
    before = list(nc.published)
    await job.on_retransmit(1)
    assert nc.published[len(before):] == before, "the Head and the chunk, as sent"
    job.cancel("client_disconnected")
    await asyncio.wait_for(task, 5)


async def test_a_job_without_a_mux_publishes_even_when_the_worker_has_an_outbox() -> None:
    outbox = Outbox()
    job, _, nc = make_job(FakeBackend(FakeStream(events(1))))
    job = Job(job.msg, job.request, job.backend,  # type: ignore[arg-type]
              dataclasses.replace(job.ctx, outbox=outbox))  # type: ignore[arg-type]
    await asyncio.wait_for(job.run(), 5)
    assert outbox.puts == []
    assert kinds(nc) == ["Head", "Chunk", "Done"]
