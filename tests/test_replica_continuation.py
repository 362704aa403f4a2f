"""A backend replica that fails mid-stream while its worker lives (issue 25,
items 3 and 5): the worker continues the stream itself on another replica
from the text it sent (workers/replica_continuation.py).

Unit, without servers: what can be continued, the text read from the sent
chunks, the joined stream's seam and usage, and a Job with two fake
replicas (the seams of tests/test_job_unit.py): what the edge receives,
what the second replica is asked, the breakers, the usage record. The same
against real servers is tests/test_replica_continuation_pipeline.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from typing import Any

from tests.test_job_unit import CONFIG, FakeMsg, FakeNats, FakeStream, kinds
from tidegate.errors import BackendError
from tidegate.wire.protocol import Api, Chunk, Continue, Done, Error, Request
from workers.backends import Usage
from workers.continuation import JoinedStream, continued_stream, joined
from workers.job import Job
from workers.job_context import JobContext
from workers.replica_continuation import (
    MAX_FAILURES,
    Continuation,
    Sent,
    continuable,
)
from workers.replicas import Breaker, ReplicaSet

BROKEN = BackendError(502, "connection broke mid-stream", type="server_error",
                      code="backend_error")
SLOW = BackendError(504, "went silent mid-stream", type="server_error", code="backend_timeout")


def request(api: Api = Api.CHAT, **body: Any) -> Request:
    base: dict[str, Any] = ({"messages": [{"role": "user", "content": "hi"}]} if api is Api.CHAT
                            else {"prompt": "once"})
    return Request(id="r1", reply="tg.out.e.r1", model="m", api=api, stream=True,
                   body={**base, **body}, created_ms=0, deadline_ms=0, window_bytes=1 << 20,
                   window_msgs=128)


def role() -> bytes:
    return b'data: {"id":"x","choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n'


def word(text: str, api: Api = Api.CHAT) -> bytes:
    if api is Api.COMPLETIONS:
        return b'data: {"id":"x","choices":[{"index":0,"text":%s}]}\n\n' % json.dumps(
            text).encode()
    return b'data: {"id":"x","choices":[{"index":0,"delta":{"content":%s}}]}\n\n' % json.dumps(
        text).encode()


# -- sans-I/O --------------------------------------------------------------------------


def test_what_a_worker_continues() -> None:
    assert continuable(request(), "continue")
    assert continuable(request(Api.COMPLETIONS), "continue")
    assert not continuable(request(), "restart")
    assert not continuable(request(), "off")
    for body in ({"n": 2}, {"logprobs": True}, {"top_logprobs": 2},
                 {"tools": [{"type": "function"}]}, {"functions": [{}]}):
        assert not continuable(request(**body), "continue"), body
    assert not continuable(request(Api.COMPLETIONS, echo=True), "continue")
    assert not continuable(request(Api.RESPONSES), "continue")
    # A resumable one too: the same job goes on, so its stream log reads as one stream.
    assert continuable(dataclasses.replace(request(), resumable=True), "continue")
    assert not continuable(dataclasses.replace(request(), stream=False), "continue")


def test_the_sent_text_is_read_once_at_failure() -> None:
    sent = Sent()
    sent.parts += [role() + word("Hel"), word("lo \u00e9"), b'data: {"choices":[],"usage":null}'
                   b"\n\n"]
    assert sent.text(Api.CHAT) == ("Hello \u00e9", 2, "x"), "with the response id sent"
    completions = Sent()
    completions.parts += [word("on", Api.COMPLETIONS), word("ce", Api.COMPLETIONS)]
    assert completions.text(Api.COMPLETIONS) == ("once", 2, "x")
    tool = Sent()
    tool.parts.append(b'data: {"choices":[{"index":0,"delta":{"tool_calls":[{"index":0}]}}]}\n\n')
    assert tool.text(Api.CHAT) is None
    two = Sent()
    two.parts.append(b'data: {"choices":[{"index":0,"delta":{}},{"index":1,"delta":{}}]}\n\n')
    assert two.text(Api.CHAT) is None
    assert Sent().text(Api.CHAT) == ("", 0, "")


class Reads:
    def __init__(self, *parts: bytes, usage: Usage | None = None) -> None:
        self.parts = list(parts)
        self.usage = usage or Usage()
        self.closed = False

    async def read(self, max_bytes: int) -> bytes:
        return self.parts.pop(0) if self.parts else b""

    async def aclose(self) -> None:
        self.closed = True


async def test_the_joined_stream_drops_the_opening_and_counts_the_whole_response() -> None:
    usage_event = (b'data: {"id":"x","choices":[],"usage":{"prompt_tokens":12,'
                   b'"completion_tokens":3,"total_tokens":15}}\n\n')
    inner = Reads(role() + word(" on"), word(" and"), word(" on") + usage_event,
                  usage=Usage(12, 3, "stop", 4))
    joined = JoinedStream(inner, request(), Usage(prompt_tokens=8, completion_tokens=5,
                                                  cached_tokens=1))  # type: ignore[arg-type]
    out = [await joined.read(100) for _ in range(4)]
    assert out[:2] == [word(" on"), word(" and")]
    assert out[2].startswith(word(" on"))
    # The tenant pays the request's own prompt once: this call's 12 less the
    # 5 delivered tokens it reads again; the broken call's 8 and those 5 are
    # the operator's.
    usage = json.loads(out[2][len(word(" on")) + 6:])["usage"]
    assert usage == {"prompt_tokens": 7, "completion_tokens": 8, "total_tokens": 15}
    assert out[3] == b""
    assert joined.usage == Usage(7, 8, "stop", 5, operator_prompt_tokens=13)
    assert joined.call_usage == Usage(12, 3, "stop", 4)
    await joined.aclose()
    assert inner.closed


def test_the_tenant_pays_one_prompt_the_operator_the_rest() -> None:
    # The continuing call's prompt less the delivered events it reads again.
    assert joined(Usage(0, 5), Usage(12, 3, "stop", 9)) == Usage(
        7, 8, "stop", 7, operator_prompt_tokens=5)
    # No call followed the broken one (the limit was reached): its prompt.
    assert joined(Usage(9, 4, cached_tokens=2), Usage(0, 0, "length")) == Usage(
        9, 4, "length", 2)
    # A backend counting fewer prompt tokens than was delivered: never below 0.
    assert joined(Usage(0, 50), Usage(20, 1, "stop", 20)) == Usage(
        0, 51, "stop", 0, operator_prompt_tokens=20)
    # Continued twice: each continuation's extra is the operator's.
    twice = joined(Usage(0, 6), Usage(15, 2, "", operator_prompt_tokens=4))
    assert (twice.prompt_tokens, twice.operator_prompt_tokens) == (9, 10)


async def test_an_edge_continuation_counts_what_the_dead_worker_delivered() -> None:
    """A worker's death (the edge's Continue with 5 delivered events): the
    continuing stream's usage chunk, and the usage Done and the usage record
    take, count those 5 with its own 3: the client got one response of 8.
    Its prompt is the request's own: the call's 12 less the 5 it read again."""
    usage_event = (b'data: {"id":"x","choices":[],"usage":{"prompt_tokens":12,'
                   b'"completion_tokens":3,"total_tokens":15}}\n\n')
    inner = Reads(role() + word(" on"), word(" and") + usage_event,
                  usage=Usage(12, 3, "stop"))
    stream = continued_stream(inner, request(), Continue("r1", "Hello", 5))  # type: ignore[arg-type]
    out = b"".join([await stream.read(100) for _ in range(3)])
    assert out.startswith(word(" on") + word(" and")), "the role chunk dropped"
    usage = json.loads(out[len(word(" on") + word(" and")) + 6:])["usage"]
    assert usage == {"prompt_tokens": 7, "completion_tokens": 8, "total_tokens": 15}
    assert stream.usage == Usage(7, 8, "stop", operator_prompt_tokens=5)


async def test_a_continuation_keeps_the_response_id_the_client_saw() -> None:
    """A real backend names every call anew: the continuing call's id (read
    from its first event, the dropped role chunk) becomes the client's in
    every event after it, however the reads cut them."""
    def event(rid: bytes, text: str) -> bytes:
        return word(text).replace(b'"id":"x"', b'"id": "' + rid + b'"')
    inner = Reads(event(b"new-1", "").replace(b'"content":""', b'"role":"assistant","content":""'),
                  event(b"new-1", " on") + event(b"new-1", " and"), event(b"new-1", " on"),
                  usage=Usage(3, 3, "stop"))
    stream = continued_stream(inner, request(), Continue("r1", "Hello", 1, response_id="old-7"))  # type: ignore[arg-type]
    out = b"".join([await stream.read(100) for _ in range(4)])
    assert b"new-1" not in out, out
    assert out == word(" on").replace(b'"x"', b'"old-7"') + word(" and").replace(
        b'"x"', b'"old-7"') + word(" on").replace(b'"x"', b'"old-7"')
    same = continued_stream(Reads(role(), word(" on")), request(),  # type: ignore[arg-type]
                            Continue("r1", "Hello", 1, response_id="x"))
    assert b"".join([await same.read(100) for _ in range(3)]) == word(" on"), "nothing to rename"


def test_others_never_names_the_failed_replica_nor_an_open_breaker() -> None:
    replicas = ReplicaSet()
    for name in ("a", "b", "c"):
        replicas.add(name, None, Breaker(failures=1))  # type: ignore[arg-type]
    assert [n for n, _ in replicas.others("a", 0.0)] == ["b", "c"]
    replicas.breakers["c"].failure(0.0)
    assert [n for n, _ in replicas.others("a", 0.1)] == ["b"]


# -- a job on two fake replicas ---------------------------------------------------------------


class Replica:
    """A fake replica: each open() takes the next stream (or refusal) and
    records the request."""

    def __init__(self, *streams: FakeStream | BackendError) -> None:
        self.streams = list(streams)
        self.requests: list[Request] = []

    async def open(self, req: Request) -> FakeStream:
        self.requests.append(req)
        nxt = self.streams.pop(0)
        if isinstance(nxt, BackendError):
            raise nxt
        return nxt

    async def aclose(self) -> None:
        pass


def on_replicas(req: Request, failover: str = "continue", **replicas: Replica
                ) -> tuple[Job, FakeMsg, FakeNats, ReplicaSet]:
    msg, nc = FakeMsg(), FakeNats()
    ctx = JobContext(config=CONFIG, nc=nc, control_subject="tg.ctl.w1")  # type: ignore[arg-type]
    rs = ReplicaSet(failover=failover)
    for name, backend in replicas.items():
        rs.add(name, backend, Breaker(failures=1))  # type: ignore[arg-type]
    first = next(iter(replicas))
    job = Job(msg, req, rs.backends[first], ctx)  # type: ignore[arg-type]
    job.replicas, job.replica = rs, first
    return job, msg, nc, rs


def chunks(nc: FakeNats) -> bytes:
    return b"".join(m.data for m in nc.session() if isinstance(m, Chunk))


async def test_a_stream_broken_mid_way_goes_on_on_the_other_replica() -> None:
    a = Replica(FakeStream([role() + word("Hel"), word("lo")], usage=Usage(7, 0, ""),
                           fail=BROKEN))
    b = Replica(FakeStream([role() + word(" wor"), word("ld")], usage=Usage(9, 0, "")))
    job, msg, nc, rs = on_replicas(request(max_tokens=10, stop=["\n"]), a=a, b=b)
    await asyncio.wait_for(job.run(), 5)
    assert kinds(nc) == ["Head", "Chunk", "Chunk", "Chunk", "Chunk", "Done"]
    assert [m.seq for m in nc.session()] == [1, 2, 3, 4, 5, 6], "one job: seqs go on"
    assert chunks(nc) == role() + word("Hel") + word("lo") + word(" wor") + word("ld"), \
        "the role chunk once, nothing repeated or missing"
    [asked] = b.requests
    assert asked.body["messages"][-1] == {"role": "assistant", "content": "Hello"}
    assert (asked.body["continue_final_message"], asked.body["add_generation_prompt"]) == (
        True, False)
    assert (asked.body["max_tokens"], asked.body["stop"]) == (8, ["\n"])
    done = nc.session()[-1]
    assert isinstance(done, Done)
    # The tenant pays a's prompt once (b's 9 less the 2 delivered tokens it
    # read again); the rest, 7 + 9 - 7, is the operator's.
    assert (done.prompt_tokens, done.completion_tokens) == (7, 2 + 2)
    [record] = nc.usage()
    assert (record.outcome, record.prompt_tokens, record.completion_tokens,
            record.operator_prompt_tokens) == ("done", 7, 4, 9)
    assert rs.breakers["a"].state.value == "open", "the failure counts in a's breaker"
    assert rs.breakers["b"].state.value == "closed"
    assert job.running == "b"
    assert msg.fate[-1] == "ack"


async def test_completions_continue_from_prompt_plus_text() -> None:
    a = Replica(FakeStream([word("on", Api.COMPLETIONS)], fail=BROKEN))
    b = Replica(FakeStream([word("ce", Api.COMPLETIONS)]))
    job, _, nc, _ = on_replicas(request(Api.COMPLETIONS, max_tokens=4), a=a, b=b)
    await asyncio.wait_for(job.run(), 5)
    assert kinds(nc)[-1] == "Done"
    assert chunks(nc) == word("on", Api.COMPLETIONS) + word("ce", Api.COMPLETIONS)
    assert (b.requests[0].body["prompt"], b.requests[0].body["max_tokens"]) == ("onceon", 3)


async def test_nothing_sent_yet_runs_the_request_again_elsewhere() -> None:
    a = Replica(FakeStream([], fail=BROKEN))
    b = Replica(FakeStream([role() + word("Hi")]))
    job, _, nc, _ = on_replicas(request(logprobs=True), a=a, b=b)  # even not continuable
    await asyncio.wait_for(job.run(), 5)
    assert kinds(nc)[-1] == "Done"
    assert chunks(nc) == role() + word("Hi")
    assert b.requests[0].body == request(logprobs=True).body


async def test_only_the_role_chunk_sent_runs_the_request_again_without_it() -> None:
    a = Replica(FakeStream([role()], fail=BROKEN))
    b = Replica(FakeStream([role() + word("Hi")]))
    job, _, nc, _ = on_replicas(request(), a=a, b=b)
    await asyncio.wait_for(job.run(), 5)
    assert chunks(nc) == role() + word("Hi")
    assert b.requests[0].body == request().body


async def test_what_is_not_continued_keeps_its_error() -> None:
    cases: list[tuple[Request, str, BackendError, bool]] = [
        (request(logprobs=True), "continue", BROKEN, True),  # not continuable
        (request(), "restart", BROKEN, True),  # failover is not "continue"
        (request(), "off", BROKEN, True),
        (request(), "continue", SLOW, False),  # a slow backend: the request's, not the replica's
    ]
    for req, failover, failure, counted in cases:
        a = Replica(FakeStream([role() + word("Hel")], fail=failure))
        b = Replica(FakeStream([word("lo")]))
        job, msg, nc, rs = on_replicas(req, failover, a=a, b=b)
        await asyncio.wait_for(job.run(), 5)
        assert kinds(nc) == ["Head", "Chunk", "Error"], (req.body, failover)
        error = nc.session()[-1]
        assert isinstance(error, Error)
        assert error.error.code == failure.code
        assert b.requests == []
        assert (rs.breakers["a"].state.value == "open") is counted
        assert msg.fate[-1] == "ack"


async def test_one_replica_or_every_other_breaker_open_keeps_the_error() -> None:
    a = Replica(FakeStream([role() + word("Hel")], fail=BROKEN))
    job, _, nc, _ = on_replicas(request(), a=a)
    await asyncio.wait_for(job.run(), 5)
    assert kinds(nc) == ["Head", "Chunk", "Error"]
    a = Replica(FakeStream([role() + word("Hel")], fail=BROKEN))
    b = Replica(FakeStream([word("lo")]))
    job, _, nc, rs = on_replicas(request(), a=a, b=b)
    rs.breakers["b"].failure(1e12)  # open, its cooldown far ahead
    await asyncio.wait_for(job.run(), 5)
    assert kinds(nc) == ["Head", "Chunk", "Error"]
    assert b.requests == []


async def test_the_other_replica_refusing_too_keeps_the_first_error() -> None:
    a = Replica(FakeStream([role() + word("Hel")], fail=BROKEN))
    b = Replica(BackendError(502, "refused", type="server_error", code="backend_unavailable"))
    job, _, nc, rs = on_replicas(request(), a=a, b=b)
    await asyncio.wait_for(job.run(), 5)
    error = nc.session()[-1]
    assert isinstance(error, Error)
    assert error.error.message == BROKEN.message
    assert rs.breakers["b"].state.value == "open"


async def test_a_continuation_that_breaks_goes_on_again_within_the_bound() -> None:
    streams: dict[str, list[FakeStream | BackendError]] = {"a": [], "b": []}
    for i in range(MAX_FAILURES + 1):
        streams["ab"[i % 2]].append(FakeStream([word(f"w{i} ")], fail=BROKEN))
    a, b = Replica(*streams["a"]), Replica(*streams["b"])
    job, _, nc, rs = on_replicas(request(), a=a, b=b)
    for breaker in rs.breakers.values():
        breaker.failures = 100  # stay closed: the bound, not the breakers, ends it
    await asyncio.wait_for(job.run(), 5)
    assert kinds(nc)[-1] == "Error"
    assert len(a.requests) + len(b.requests) == MAX_FAILURES + 1
    texts = [r.body["messages"][-1]["content"] for r in (*a.requests, *b.requests)
             if r.body["messages"][-1]["role"] == "assistant"]
    assert "w0 w1 w2 " in texts, "each continuation carries everything sent so far"


async def test_an_edge_continued_job_continues_from_both_texts() -> None:
    """A job that is itself an edge's continuation (its first worker died)
    whose replica then fails: the text goes on from both."""
    a = Replica(FakeStream([role() + word("lo")], usage=Usage(7, 0, ""), fail=BROKEN))
    b = Replica(FakeStream([role() + word(" world")]))
    job, _, nc, _ = on_replicas(request(max_tokens=10), a=a, b=b)
    job.on_continue(Continue(job.request.id, "Hel", 1))
    await asyncio.wait_for(job.run(), 5)
    assert chunks(nc) == word("lo") + word(" world")
    body = b.requests[0].body
    assert body["messages"] == [{"role": "user", "content": "hi"},
                                {"role": "assistant", "content": "Hello"}]
    assert body["max_tokens"] == 8


def test_a_continuation_counts_its_failed_calls() -> None:
    kept = Continuation(request())
    kept.sent.parts.append(role() + word("a"))
    assert kept.failed(FakeStream([], usage=Usage(5, 1, ""))) == ("a", 1)
    assert kept.spent == Usage(5, 1, "", 0)
    assert Continuation(request(), keeps=False).failed(FakeStream([])) is None
