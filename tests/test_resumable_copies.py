"""workers/resumable.py's redelivered copies, with tests/test_resumable_rules.py's
fakes: whether a copy runs, continues its stream's log or drops, by the edge's
word, a hand-back, the first worker's liveness answer and this worker's tails
(chat and Responses); and the log read back entry by entry on a real
nats-server. Found by mutation testing (docs/testing.md).
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import nats
import pytest

from tests.test_job_unit import (
    REPLY,
    FakeBackend,
    FakeMsg,
    FakeStream,
)
from tests.test_resumable_rules import (
    CHAT_BODY,
    OTHER,
    OWN,
    QUIET,
    configured,
    rig,
    running,
    stalled,
)
from tidegate import config as tgconfig
from tidegate.broker import broker, liveness
from tidegate.wire import streamlog
from tidegate.wire.flow import first_seq
from tidegate.wire.protocol import (
    Api,
    Chunk,
    Continue,
    Done,
    Head,
    Heartbeat,
    Request,
)
from tidegate.wire.streamlog import LogCursor, LogEntry, LogEvent, LogHandBack
from workers.job_context import JobContext
from workers.resumable import ResumableJob
from workers.tails import Tails

# -- a redelivered copy: runs, continues the log, or not ----------------------------


def chat_event(text: str, response_id: str | None = "chatcmpl-r1") -> bytes:
    event: dict[str, Any] = {"object": "chat.completion.chunk",
                             "choices": [{"index": 0, "delta": {"content": text}}]}
    if response_id is not None:
        event["id"] = response_id
    return b"data: " + json.dumps(event).encode() + b"\n\n"


def responses_events(item: str = "message") -> list[bytes]:
    opening: list[dict[str, Any]] = [
        {"type": "response.created", "response": {"id": "resp_1"}},
        {"type": "response.in_progress", "response": {"id": "resp_1"}},
        {"type": "response.output_item.added", "output_index": 0,
         "item": {"id": "msg_1", "type": item, "role": "assistant", "content": []}},
        {"type": "response.content_part.added", "item_id": "msg_1", "output_index": 0,
         "content_index": 0, "part": {"type": "output_text", "text": ""}},
        {"type": "response.output_text.delta", "item_id": "msg_1", "output_index": 0,
         "content_index": 0, "delta": "Hel"},
        {"type": "response.output_text.delta", "item_id": "msg_1", "output_index": 0,
         "content_index": 0, "delta": "lo"},
    ]
    return [b"event: %s\ndata: %s\n\n" % (e["type"].encode(), json.dumps(
        {**e, "sequence_number": n}).encode()) for n, e in enumerate(opening)]


HELLO = [chat_event("Hel"), chat_event("lo")]
RESPONSES_BODY = {"model": "m", "input": "hi", "max_output_tokens": 10}


def log_of(*entries: LogEntry) -> tuple[LogCursor, list[bytes]]:
    """The log a copy reads: its cursor and its events, as ``_read_log`` gives them."""
    cursor, out = LogCursor(), []
    for entry in entries:
        out += [i.data for i in cursor.feed(entry) if isinstance(i, LogEvent)]
    return cursor, out


def output(*data: bytes, control: str = OTHER) -> list[LogEntry]:
    """A first worker's Head and chunks in the log."""
    return [Head(1, control, 42, 1), *(Chunk(2 + n, d) for n, d in enumerate(data))]


def chat_continued(text: str, tokens: int) -> dict[str, Any]:
    return {"model": "m", "max_tokens": 10 - tokens, "continue_final_message": True,
            "add_generation_prompt": False,
            "messages": [*CHAT_BODY["messages"], {"role": "assistant", "content": text}]}


@dataclass
class Case:
    """A redelivered copy: its log (None: unreadable), its edge's word
    ("ack": Ack seq 0, "continue": a Continue, "": none), what the log's
    worker says when asked, and what the copy does: "fresh" (runs the
    request as it came), "continues" (the log's text, ``go``), "no"
    (dropped, acked) or "duplicate" (ends without a trace)."""

    log: list[LogEntry] | None
    word: str
    does: str
    answer: str | None = None
    asked: bool = False
    go: Continue | None = None
    body: dict[str, Any] | None = None  # the backend's request body (default: as it came)
    config: tgconfig.Config = QUIET
    api: Api = Api.CHAT
    request_body: dict[str, Any] = field(default_factory=lambda: CHAT_BODY)
    tails_ended: bool = False


CASES = {
    # The edge's word first.
    "ack_0_runs_again_and_reads_no_more": Case(
        output(*HELLO), "ack", "fresh", answer=liveness.RUNNING),
    "continue_continues_the_logs_text": Case(
        output(*HELLO), "continue", "continues", answer=liveness.RUNNING,
        go=Continue("r1", "Hello", 2, 0, "chatcmpl-r1"), body=chat_continued("Hello", 2)),
    "continue_of_a_model_that_does_not_continue": Case(
        output(*HELLO), "continue", "no", config=configured("off")),
    "continue_of_a_request_that_cannot_be": Case(
        output(*HELLO), "continue", "no",
        request_body={**CHAT_BODY, "tools": [{"type": "function"}]}),
    "continue_of_an_ended_log": Case(
        [*output(*HELLO), Done(4, 1, 2, "stop")], "continue", "no"),
    "continue_of_an_unparsable_log": Case(
        output(b'data: {"id": "chatcmpl-r1", "choi\n\n'), "continue", "no"),
    "continue_of_a_tool_call": Case(
        output(b'data: {"id": "c", "choices": [{"index": 0, "delta": {"tool_calls": '
               b'[{"index": 0}]}}]}\n\n'), "continue", "no"),
    "continue_of_a_log_of_no_event": Case(
        output(b": keep-alive\n\n"), "continue", "continues",
        go=Continue("r1", "", 0, 0, ""), body=chat_continued("", 0)),
    "continue_a_responses_stream_at_its_seam": Case(
        output(*responses_events()), "continue", "continues", api=Api.RESPONSES,
        request_body=RESPONSES_BODY, go=Continue("r1", "Hello", 2, 6, "resp_1", "msg_1", 4),
        body={"model": "m", "max_output_tokens": 8, "input": [
            {"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello"}]}),
    "continue_a_responses_stream_of_a_reasoning_item": Case(
        output(*responses_events("reasoning")), "continue", "no", api=Api.RESPONSES,
        request_body=RESPONSES_BODY),
    # The log's hand-back is its edge's word, whatever else an edge says.
    "hand_back_continues_without_asking": Case(
        [*output(*HELLO), LogHandBack(OTHER)], "ack", "continues", answer=liveness.RUNNING,
        go=Continue("r1", "Hello", 2, 0, "chatcmpl-r1"), body=chat_continued("Hello", 2)),
    # No word: the log's worker is asked.
    "silent_its_first_worker_still_runs_it": Case(
        output(*HELLO), "", "duplicate", answer=liveness.RUNNING, asked=True),
    "silent_its_first_worker_is_gone": Case(
        output(*HELLO), "", "continues", answer=liveness.GONE, asked=True,
        go=Continue("r1", "Hello", 2, 0, "chatcmpl-r1"), body=chat_continued("Hello", 2)),
    "silent_its_first_worker_ended_it_its_log_lost_the_rest": Case(
        output(), "", "no", answer=liveness.ENDED, asked=True),
    "silent_no_answer_output": Case(output(*HELLO), "", "no", answer=None, asked=True),
    "silent_no_answer_no_output": Case(output(), "", "fresh", answer=None, asked=True),
    "silent_asking_turned_off": Case(
        output(*HELLO), "", "no", answer=liveness.RUNNING,
        config=configured(session={"liveness_interval": 0})),
    "silent_this_worker_ended_it_its_log_lost_the_rest": Case(
        output(control=OWN), "", "no", tails_ended=True),
    "unreadable_log_silent": Case(None, "", "no"),
    "unreadable_log_ack_0": Case(None, "ack", "fresh"),
}


@pytest.mark.parametrize("name", list(CASES))
async def test_a_redelivered_copy(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    case = CASES[name]
    asked: list[tuple[Any, ...]] = []

    async def runs(nc: Any, presence: str, request_id: str, interval: float) -> str | None:
        asked.append((nc, presence, request_id, interval))
        return case.answer

    monkeypatch.setattr(liveness, "runs", runs)
    tails = None
    if case.tails_ended:
        tails = Tails(30.0)
        tails.keep(Request(id="r1", reply=REPLY, model="m", api=Api.CHAT, stream=True,
                           body={}, created_ms=0, deadline_ms=0, window_bytes=1,
                           window_msgs=1), [(2, Done(2, 1, 0, "stop").encode())])
    r = rig(case.config, stream=FakeStream([]), delivered=2, api=case.api,
            body=case.request_body, tails=tails)
    job = r.job

    async def read_log() -> tuple[LogCursor, list[bytes]] | None:
        return None if case.log is None else log_of(*case.log)

    job._read_log = read_log  # type: ignore[method-assign]
    if case.word == "ack":
        r.nc.answer = lambda: job.on_ack(0)
    elif case.word == "continue":  # the edge's text is not the log's: the log's is continued
        r.nc.answer = lambda: job.on_continue(Continue("r1", "edge's text", 1))
    await job.run()
    job.release()

    config = case.config
    presence = config.nats.subjects.presence_of(OTHER)
    assert asked == ([(r.nc, presence, "r1", config.session.liveness_interval)]
                     if case.asked else [])
    records = [u.outcome for u in r.nc.usage()]
    if case.does in ("fresh", "continues"):
        [request] = r.backend.requests
        assert request.body == (case.body or case.request_body)
        assert job.continued == case.go
        assert records == ["done"]
        head = r.log.messages()[0]
        assert isinstance(head, Head), "its Head is not logged"
        assert head.seq == first_seq(2)
        return
    assert r.backend.opened == 0
    assert r.log.puts == [], "a copy that does not run wrote to the log"
    if case.does == "no":
        assert records == ["dropped"]
        assert r.msg.fate[-1] == "ack"
    else:
        assert records == []
        assert set(r.msg.fate) <= {"in_progress"}, r.msg.fate


async def test_a_continued_copy_writes_on_as_the_clients_response_into_the_log() -> None:
    """The continuation's chunks carry the id the client saw (the log's first
    event's), its role chunk is dropped, its usage counts the log's events,
    and it goes on without a reader's acks (its client resumes from the log)."""
    role = b'data: {"id": "chatcmpl-new", "choices": [{"index": 0, "delta": ' \
        b'{"role": "assistant"}}]}\n\n'
    more = [role, *(chat_event(t, "chatcmpl-new") for t in (" wor", "ld", "!"))]
    stream = FakeStream(more)
    r = rig(stream=stream, delivered=2, window_msgs=2)
    job = r.job

    async def read_log() -> tuple[LogCursor, list[bytes]]:
        return log_of(*output(*HELLO))

    job._read_log = read_log  # type: ignore[method-assign]
    r.nc.answer = lambda: job.on_continue(Continue("r1", "Hel", 1))
    async with running(r) as task:
        await r.changes.until(lambda: task.done() or stalled(r))
        assert task.done(), "a continued copy waited for a reader's acks"
    chunks = [json.loads(m.data[6:]) for m in r.log.messages() if isinstance(m, Chunk)]
    assert chunks == [json.loads(chat_event(t)[6:]) for t in (" wor", "ld", "!")]
    done = r.log.messages()[-1]
    assert isinstance(done, Done)
    assert done.completion_tokens == 2 + stream.usage.completion_tokens


@pytest.mark.parametrize("ids", [True, False])
async def test_a_continuation_its_log_used_up_ends_without_the_backend(ids: bool) -> None:
    """The log's events already reach ``max_tokens``: the copy writes the
    end itself (``finish_reason: "length"``, the client's response id, or
    none when its events had none) and calls no backend."""
    body = {**CHAT_BODY, "max_tokens": 2}
    r = rig(delivered=2, body=body)
    job = r.job
    response_id = "chatcmpl-r1" if ids else None

    async def read_log() -> tuple[LogCursor, list[bytes]]:
        return log_of(*output(chat_event("Hel", response_id), chat_event("lo", response_id)))

    job._read_log = read_log  # type: ignore[method-assign]
    r.nc.answer = lambda: job.on_continue(Continue("r1", "Hello", 2))
    await job.run()
    job.release()
    assert r.backend.opened == 0
    logged = r.log.messages()
    assert [type(m).__name__ for m in logged] == ["Head", "Chunk", "Done"]
    assert isinstance(logged[1], Chunk)
    [event] = [json.loads(line[6:]) for line in logged[1].data.split(b"\n")
               if line.startswith(b"data: {")]
    assert event["id"] == ("chatcmpl-r1" if ids else "")
    assert event["choices"][0]["finish_reason"] == "length"


# -- the log read back (a real nats-server) -----------------------------------------


async def test_a_copy_reads_its_log_entry_by_entry_among_other_streams(
        module_nats_url: str) -> None:
    """Its entries, in stream order, between another stream's, up to its
    last: the first worker's Head and chunks, then a continuing worker's
    (its seqs start again and its events go on)."""
    config = tgconfig.from_dict({"nats": {"url": module_nats_url,
                                          "subject_prefix": "rr" + uuid.uuid4().hex[:8]}})
    subjects = config.nats.subjects
    mine, other = streamlog.subject(subjects, "r1"), streamlog.subject(subjects, "r2")
    ev = [chat_event(t) for t in ("a", "b", "c", "d")]
    again = first_seq(2)
    nc = await nats.connect(module_nats_url)
    try:
        js = nc.jetstream()
        await broker.ensure_streams(js, config)
        log: list[tuple[str, list[LogEntry]]] = [
                (mine, [Head(1, OWN, 7, 1), Chunk(2, ev[0])]),
                (mine, [Chunk(3, ev[1])]),
                (other, [Head(1, "tg.ctl.w3", 8, 1), Chunk(2, chat_event("x"))]),
                (mine, [Head(again, OTHER, 7, 2), Chunk(again + 1, ev[2])]),
                (other, [Chunk(3, chat_event("y"))]),
                (mine, [Chunk(again + 2, ev[3]), Heartbeat(again + 3)])]
        for subject, entries in log:
            await js.publish(subject, streamlog.batch(subject.rsplit(".", 1)[1],
                                                      [e.encode() for e in entries]))
        ctx = JobContext(config=config, nc=nc, control_subject=OWN)
        now_ms = int(time.time() * 1000)
        request = Request(id="r1", reply=REPLY, model="m", api=Api.CHAT, stream=True,
                          body={}, created_ms=now_ms, deadline_ms=now_ms + 60_000,
                          window_bytes=1 << 20, window_msgs=128, resumable=True)
        job = ResumableJob(FakeMsg(delivered=3), request, FakeBackend(), ctx)  # type: ignore[arg-type]
        read = await job._read_log()
        assert read is not None
        cursor, got = read
        assert got == ev
        assert (cursor.control, cursor.output, cursor.ended) == (OTHER, True, False)

        await js.publish(mine, b"\x00 not an entry")
        assert await job._read_log() is None, "an unreadable log read as readable"
    finally:
        await nc.close()
