"""What a worker's job promises its edge, the billing and the limiter, one
rule a test (issue 42: each test kills a mutant of workers/job.py that the
pipeline tests never reach in process).

On test_job_unit's fakes: the price in the Done and the usage record, the
owner of a Responses answer recorded before its Done, the latency samples
the adaptive limit is given, a continued job's request and response id, the
seqs of every message (heartbeats and errors too), a job aborted after it
raised, a second cancel, and the helper tasks (heartbeats, in-progress acks).
Flow control, the push path and retransmits: tests/test_job_rules_flow.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from typing import Any

from tests.poll import eventually
from tests.test_job_metrics import Observed
from tests.test_job_unit import (
    CONFIG,
    FakeBackend,
    FakeMsg,
    FakeStream,
    events,
    kinds,
    make_job,
    start,
)
from tests.test_replica_continuation import BROKEN, Replica, on_replicas, request, role, word
from tidegate import config as tgconfig
from tidegate.control import prices
from tidegate.errors import BackendError
from tidegate.wire.protocol import Api, Chunk, Continue, Done, Error, ErrorInfo, Heartbeat
from workers.backends import Usage
from workers.job import Job
from workers.job_state import WORKER_SHUTDOWN

# -- the price: the Done, the usage record --------------------------------------------

# test_job_unit's CONFIG (its session and worker timings), with a priced model.
PRICED = dataclasses.replace(
    CONFIG, spend=dataclasses.replace(CONFIG.spend, currency="EUR"),
    models=(tgconfig.ModelConfig(name="m", price_input=2.0, price_cached_input=0.5,
                                 price_output=8.0, price_request=0.25),))


def priced(stream: FakeStream) -> tuple[Job, Any, Any]:
    job, msg, nc = make_job(FakeBackend(stream))
    job.ctx = dataclasses.replace(job.ctx, prices=prices.PriceBook(PRICED))
    return job, msg, nc


async def test_the_done_and_the_record_carry_the_price_of_every_token() -> None:
    job, _, nc = priced(FakeStream(events(3), usage=Usage(1000, 0, "", 400)))
    await asyncio.wait_for(job.run(), 5)
    price = prices.PriceBook(PRICED).get("m")
    assert price is not None
    nanos = price.cost(1000, 3, 400)
    assert nanos != price.cost(1000, 3, 0) != price.cost(0, 3, 0) != price.cost(1000, 0, 0)
    done = nc.session()[-1]
    assert isinstance(done, Done)
    assert done.cost == prices.format_money(nanos)
    [record] = nc.usage()
    assert (record.cost_nanos, record.currency) == (nanos, "EUR")


async def test_a_done_job_with_no_output_still_pays_its_request() -> None:
    job, _, nc = priced(FakeStream([], usage=Usage(10, 0, "")))
    await asyncio.wait_for(job.run(), 5)
    done = nc.session()[-1]
    assert isinstance(done, Done)
    assert done.cost == prices.format_money(prices.to_nanos(prices.parse_amount(0.25, "r")
                                                           + prices.parse_amount(20, "i")
                                                           / 1_000_000))


async def test_no_price_no_cost() -> None:
    job, _, nc = make_job(FakeBackend(FakeStream(events(2))))
    await asyncio.wait_for(job.run(), 5)
    done = nc.session()[-1]
    assert isinstance(done, Done)
    assert done.cost == ""
    [record] = nc.usage()
    assert (record.cost_nanos, record.currency) == (0, "")


# -- who owns a Responses answer --------------------------------------------------------


class Owners:
    """workers.owners.ResponseOwners: what was checked and recorded, and how
    many messages the edge had by then."""

    def __init__(self, sent: Any) -> None:
        self.sent, self.checked = sent, []  # type: ignore[var-annotated]
        self.recorded: list[tuple[str, str, int]] = []

    async def check(self, req: Any) -> None:
        self.checked.append(req)

    async def record(self, response_id: str, tenant: str) -> None:
        self.recorded.append((response_id, tenant, len(self.sent())))


def owned(job: Job, nc: Any, api: Api = Api.RESPONSES) -> Owners:
    """``job`` (a Responses request: one a follow-up may name) with an owners store."""
    job.request = dataclasses.replace(job.request, api=api)
    owners = Owners(nc.session)
    job.ctx = dataclasses.replace(job.ctx, owners=owners)  # type: ignore[arg-type]
    return owners


async def test_the_answers_owner_is_recorded_before_its_done() -> None:
    job, _, nc = make_job(FakeBackend(FakeStream(events(1), usage=Usage(5, 0, "",
                                                                         response_id="resp_1"))))
    owners = owned(job, nc)
    await asyncio.wait_for(job.run(), 5)
    assert owners.checked == [job.request]
    assert owners.recorded == [("resp_1", "t", 2)], "recorded after Head and chunk, before Done"
    assert kinds(nc)[-1] == "Done"


async def test_no_answer_id_nothing_recorded_and_no_store_no_record() -> None:
    job, _, nc = make_job(FakeBackend(FakeStream(events(1))))
    owners = owned(job, nc)
    await asyncio.wait_for(job.run(), 5)
    assert owners.recorded == []
    job, _, nc = make_job(FakeBackend(FakeStream(events(1), usage=Usage(5, 0, "",
                                                                         response_id="resp_1"))))
    await asyncio.wait_for(job.run(), 5)  # no owners store (unit tests, old workers)
    assert kinds(nc)[-1] == "Done"


def responses_event(kind: str, n: int, rid: str = "resp_new") -> bytes:
    return (b'event: %s\ndata: {"type":"%s","sequence_number":%d,"response":{"id":"%s"}}\n\n'
            % (kind.encode(), kind.encode(), n, rid.encode()))


async def test_a_continued_answer_is_recorded_under_the_id_the_client_saw() -> None:
    """The edge's continuation of a Responses stream (its first worker died
    before the Done, so before recording the answer): the answer is recorded
    under the id the client has, or a follow-up naming it is refused (404)."""
    stream = FakeStream([responses_event("response.created", 0),
                         responses_event("response.in_progress", 1),
                         b'event: response.output_text.delta\ndata: {"type":'
                         b'"response.output_text.delta","sequence_number":2,"delta":"lo"}\n\n'],
                        usage=Usage(5, 0, "", response_id="resp_new"))
    job, _, nc = make_job(FakeBackend(stream), FakeMsg(delivered=2))
    job.request = dataclasses.replace(request(), api=Api.RESPONSES,
                                      body={"input": "hi", "model": "m"})
    owners = owned(job, nc)
    job.on_continue(Continue("r1", "Hel", 1, response_id="resp_old", events=3, opened=2))
    await asyncio.wait_for(job.run(), 5)
    assert kinds(nc)[-1] == "Done"
    assert [r[0] for r in owners.recorded] == ["resp_old"]
    job, _, nc = make_job(FakeBackend(FakeStream(events(1))), FakeMsg(delivered=2))
    owners = owned(job, nc, Api.CHAT)
    job.on_continue(Continue("r1", "Hel", 1, response_id="chatcmpl-1"))
    await asyncio.wait_for(job.run(), 5)
    assert owners.recorded == [], "a chat completion is named in no follow-up"


# -- the adaptive limit's samples -------------------------------------------------------


class Limit:
    """workers.limiter.AdaptiveLimit's calls, as made; marks 100.0, 200.0, ..."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []

    def mark(self, *args: Any) -> float:
        self.calls.append(("mark", args, {}))
        return 100.0 * sum(c[0] == "mark" for c in self.calls)

    def __getattr__(self, name: str) -> Any:
        return lambda *args, **kwargs: self.calls.append((name, args, kwargs))


def limited(job: Job) -> Limit:
    limit = job.limit = Limit()  # type: ignore[assignment]
    return limit


async def test_a_stream_gives_its_first_byte_and_its_time_per_token() -> None:
    job, _, _ = make_job(FakeBackend(FakeStream(events(3))))
    limit = limited(job)
    await asyncio.wait_for(job.run(), 5)
    at, first = job._backend_at, job.first_chunk_at
    assert isinstance(at, float)
    assert 0 < at <= first
    assert [c[0] for c in limit.calls] == ["mark", "ttfb", "mark", "tpot"]
    assert limit.calls[0][1:] == ((at,), {})
    assert limit.calls[1][1:] == ((100.0, at, first), {})
    assert limit.calls[2][1:] == ((first,), {})
    _, args, kwargs = limit.calls[3]
    assert args[:3] == (200.0, first, 3)
    assert len(args) == 4
    assert isinstance(args[3], float)
    assert args[3] >= first
    assert kwargs == {"stalled": job.stall_time}


async def test_a_whole_answer_gives_one_sample_from_the_call() -> None:
    job, _, _ = make_job(FakeBackend(FakeStream(events(2))))
    job.request = dataclasses.replace(job.request, stream=False)
    limit = limited(job)
    await asyncio.wait_for(job.run(), 5)
    at = job._backend_at
    assert [c[0] for c in limit.calls] == ["mark", "whole"]
    _, args, kwargs = limit.calls[1]
    assert args[:3] == (100.0, at, 2)
    assert len(args) == 4
    assert isinstance(args[3], float)
    assert args[3] >= job.first_chunk_at
    assert kwargs == {"stalled": job.stall_time}


async def test_only_a_refusal_for_load_halves_the_limit() -> None:
    for status, overloaded in ((429, True), (503, True), (400, False)):
        job, _, _ = make_job(FakeBackend(refuse=BackendError(status, "no", type="server_error")))
        limit = limited(job)
        await asyncio.wait_for(job.run(), 5)
        assert [c[0] for c in limit.calls] == ["mark"] + ["overload"] * overloaded, status


async def test_a_call_another_replica_opened_gives_no_sample() -> None:
    a = Replica(BackendError(502, "down", type="server_error", code="backend_unavailable"))
    b = Replica(FakeStream([role() + word("Hi")]))
    job, _, nc, _ = on_replicas(request(), a=a, b=b)
    limit = limited(job)
    await asyncio.wait_for(job.run(), 5)
    assert kinds(nc)[-1] == "Done"
    assert [c[0] for c in limit.calls] == ["mark"], "neither replica's latency alone"
    job, _, nc, _ = on_replicas(request(), a=Replica(FakeStream([role() + word("Hi")])))
    limit = limited(job)
    await asyncio.wait_for(job.run(), 5)
    assert [c[0] for c in limit.calls] == ["mark", "ttfb", "mark", "tpot"]
    [record] = nc.usage()
    assert record.completion_tokens == 1, "the replica's stream counted"


# -- a continued job: its request, its end, its id -----------------------------------


async def test_a_continued_job_asks_the_backend_to_go_on_from_the_text() -> None:
    backend = Replica(FakeStream([role() + word("lo")]))
    job, _, nc = make_job(backend, FakeMsg(delivered=2))  # type: ignore[arg-type]
    job.request = request(max_tokens=10)
    job.on_continue(Continue("r1", "Hel", 1))
    await asyncio.wait_for(job.run(), 5)
    [asked] = backend.requests
    assert asked is job.request
    assert asked.body["messages"][-1] == {"role": "assistant", "content": "Hel"}
    assert asked.body["max_tokens"] == 9
    assert kinds(nc) == ["Head", "Chunk", "Done"]


async def test_a_continuation_whose_tokens_reached_the_limit_only_ends() -> None:
    backend = Replica(FakeStream([role() + word("more")]))
    job, msg, nc = make_job(backend, FakeMsg(delivered=2))  # type: ignore[arg-type]
    job.request = request(max_tokens=2)
    job.on_continue(Continue("r1", "Hello", 2, response_id="old-7"))
    await asyncio.wait_for(job.run(), 5)
    assert backend.requests == [], "one token more would pass the limit"
    assert kinds(nc) == ["Head", "Chunk", "Done"]
    [chunk] = [m for m in nc.session() if isinstance(m, Chunk)]
    event = json.loads(chunk.data.split(b"\n\n")[0][6:])
    assert (event["id"], event["choices"][0]["finish_reason"]) == ("old-7", "length")
    assert msg.fate[-1] == "ack"


async def test_a_continuation_run_again_on_a_replica_keeps_the_clients_id() -> None:
    def named(text: str) -> bytes:
        return word(text).replace(b'"id":"x"', b'"id":"new-1"')
    a = Replica(FakeStream([], fail=BROKEN))
    b = Replica(FakeStream([named("").replace(b'"content":""', b'"role":"assistant"'),
                            named(" on")]))
    job, _, nc, _ = on_replicas(request(), a=a, b=b)
    job.on_continue(Continue("r1", "Hel", 1, response_id="old-7"))
    await asyncio.wait_for(job.run(), 5)
    data = b"".join(m.data for m in nc.session() if isinstance(m, Chunk))
    assert data == word(" on").replace(b'"id":"x"', b'"id":"old-7"')


async def test_one_replica_keeps_no_reference_to_what_it_sent() -> None:
    job, _, nc, _ = on_replicas(request(max_tokens=2),
                                a=Replica(FakeStream([role() + word("Hel"), word("lo")],
                                                     fail=BROKEN)))
    await asyncio.wait_for(job.run(), 5)
    assert job._sent is None
    assert kinds(nc)[-1] == "Error", "nowhere to go on"


# -- errors, seqs, abort, cancels ----------------------------------------------------


async def test_a_refusal_without_a_code_keeps_its_type_and_no_code() -> None:
    job, _, nc = make_job(FakeBackend(refuse=BackendError(400, "bad",
                                                          type="invalid_request_error")))
    await asyncio.wait_for(job.run(), 5)
    error = nc.session()[-1]
    assert isinstance(error, Error)
    assert (error.error.type, error.error.code) == ("invalid_request_error", "")


async def test_every_message_has_the_next_seq() -> None:
    job, _, nc = make_job(FakeBackend(FakeStream(events(2), fail=BROKEN)))
    await asyncio.wait_for(job.run(), 5)
    assert [m.seq for m in nc.session()] == [1, 2, 3, 4]
    job, _, nc = make_job(FakeBackend(FakeStream([], hang=True)))
    await asyncio.wait_for(job.run(), 5)  # heartbeats, then the ack timeout's error
    sent = nc.session()
    assert any(isinstance(m, Heartbeat) for m in sent)
    assert [m.seq for m in sent] == list(range(1, len(sent) + 1))


class Broken(FakeStream):
    async def read(self, max_bytes: int) -> bytes:
        if self.reads:
            raise RuntimeError("a bug")
        return await super().read(max_bytes)


async def test_a_job_that_raised_ends_once_with_the_error_given() -> None:
    job, _, nc = make_job(FakeBackend(Broken(events(2))))
    try:
        await asyncio.wait_for(job.run(), 5)
    except RuntimeError:
        pass
    info = ErrorInfo(422, "invalid_request_error", "unprocessable", "bad input", False, 0.0)
    await job.abort(info)
    await job.abort(info)
    assert job.outcome == "error"
    assert kinds(nc) == ["Head", "Chunk", "Error"]
    error = nc.session()[-1]
    assert isinstance(error, Error)
    assert (error.seq, error.error) == (3, info)
    done, _, nc = make_job(FakeBackend(FakeStream(events(1))))
    await asyncio.wait_for(done.run(), 5)
    await done.abort(info)
    assert kinds(nc)[-1] == "Done", "an ended job sends nothing more"


async def test_the_first_cancel_names_the_reason() -> None:
    job, _, _ = make_job(FakeBackend(FakeStream(events(1))))
    job.cancel("client_disconnected")  # before it runs: nothing to cancel
    assert job.cancel_reason == ""
    stream = FakeStream(events(1), hang=True)
    job, msg, nc = make_job(FakeBackend(stream))
    task = await start(job)
    await eventually(lambda: "Chunk" in kinds(nc), 2.0, "a chunk out")
    job.cancel("client_disconnected")
    job.cancel(WORKER_SHUTDOWN)
    await asyncio.wait_for(task, 5)
    assert job.cancel_reason == "client_disconnected"
    assert kinds(nc)[-1] == "Chunk", "the client left: no error for it"
    assert msg.fate[-1] == "ack"


async def test_a_cancel_is_counted_and_marked_on_the_span() -> None:
    observed = Observed()
    job, _, nc = make_job(FakeBackend(FakeStream(events(1), hang=True)))
    job.ctx = dataclasses.replace(job.ctx, telemetry=observed.telemetry)
    task = await start(job)
    await eventually(lambda: "Chunk" in kinds(nc), 2.0, "a chunk out")
    job.cancel("client_disconnected")
    await asyncio.wait_for(task, 5)
    [count] = observed.points("tidegate.cancellations")
    assert count.value == 1
    assert dict(count.attributes) == {"tidegate.cancel.cause": "client_disconnected",
                                      "tidegate.tier": "worker"}
    [span] = observed.spans.get_finished_spans()
    assert [(e.name, dict(e.attributes or {})) for e in span.events] == [
        ("gen_ai.first_token", {}),
        ("tidegate.cancel", {"tidegate.cancel.cause": "client_disconnected"})]


# -- the helper tasks: heartbeats only when silent, in-progress acks in time ---------------


class Ticking(Job):
    ticks: list[Any]

    def _on_tick(self, now: float) -> None:
        self.ticks.append(now)


async def test_the_watchdog_wakes_once_a_tick_with_the_time() -> None:
    job, _, _ = make_job(FakeBackend(FakeStream([], hang=True)))
    ticking = Ticking(job.msg, job.request, job.backend, job.ctx)
    ticking.ticks = []
    task = await start(ticking)
    await asyncio.sleep(0.3)
    ticking.cancel("client_disconnected")
    await asyncio.wait_for(task, 5)
    assert ticking.ticks, "no tick"
    assert len(ticking.ticks) < 100, "the watchdog spins"
    assert all(isinstance(t, float) and t <= time.monotonic() for t in ticking.ticks)


QUIET = tgconfig.from_dict({
    "session": {"heartbeat_interval": 1.0, "ack_timeout": 10, "worker_lost_after": 6},
    "worker": {"ack_wait": 1.5, "resume_timeout": 0.3},
})


class Trickle(FakeStream):
    """A chunk every 50 ms, ``chunks`` of them."""

    async def read(self, max_bytes: int) -> bytes:
        await asyncio.sleep(0.05)
        return await super().read(max_bytes)


async def test_no_heartbeat_while_output_flows() -> None:
    job, _, nc = make_job(FakeBackend(Trickle(events(30))))  # 1.5 s of output
    job.ctx = dataclasses.replace(job.ctx, config=QUIET)
    await asyncio.wait_for(job.run(), 10)
    assert "Heartbeat" not in kinds(nc)


async def test_a_long_job_says_in_progress_before_jetstream_would_redeliver_it() -> None:
    job, msg, _ = make_job(FakeBackend(FakeStream([], hang=True)))
    job.ctx = dataclasses.replace(job.ctx, config=QUIET)
    task = await start(job)
    await eventually(lambda: "in_progress" in msg.fate, QUIET.worker.ack_wait,
                     "an in-progress ack within ack_wait")
    job.cancel("client_disconnected")
    await asyncio.wait_for(task, 5)
