"""The batch API's sans-I/O parts: status machine, records, lines, line sessions."""

from __future__ import annotations

import json
from itertools import pairwise

import pytest

from dispatcher.batch.session import Limits, LineSession, Phase, Verdict
from tidegate.wire.batch import (
    TERMINAL,
    TRANSITIONS,
    BatchRecord,
    BatchStatus,
    Counts,
    FileRecord,
    LineError,
    LineSplitter,
    LineTooLong,
    LineValidator,
    TransitionError,
    error_line,
    line_request_id,
    new_batch_id,
    new_file_id,
    output_line,
    parse_request_id,
    parse_window,
    valid_id,
)
from tidegate.wire.protocol import (
    Ack,
    Admission,
    Chunk,
    Done,
    Error,
    ErrorInfo,
    Head,
    Heartbeat,
    Status,
)

S = BatchStatus


def batch(**changes: object) -> BatchRecord:
    base = BatchRecord(id=new_batch_id(), tenant="acme", endpoint="/v1/chat/completions",
                       input_file_id=new_file_id(), completion_window="24h", created_at=100,
                       expires_at=100 + 86400, output_file_id=new_file_id(),
                       error_file_id=new_file_id())
    from dataclasses import replace
    return replace(base, **changes)  # type: ignore[arg-type]


# -- status machine -------------------------------------------------------------


@pytest.mark.parametrize("path", [
    [S.VALIDATING, S.IN_PROGRESS, S.FINALIZING, S.COMPLETED],
    [S.VALIDATING, S.FAILED],
    [S.VALIDATING, S.IN_PROGRESS, S.FINALIZING, S.EXPIRED],
    [S.VALIDATING, S.IN_PROGRESS, S.CANCELLING, S.CANCELLED],
    [S.VALIDATING, S.CANCELLING, S.CANCELLED],
])
def test_allowed_paths_stamp_their_times(path: list[BatchStatus]) -> None:
    record = batch()
    for now, (_, to) in enumerate(pairwise(path), start=200):
        record = record.moved(to, now)
    assert record.status is path[-1]
    assert record.terminal
    stamps = {"in_progress_at", "finalizing_at", "completed_at", "failed_at", "expired_at",
              "cancelling_at", "cancelled_at"}
    set_ = {s for s in stamps if getattr(record, s) is not None}
    assert set_ == {f"{s!s}_at" for s in path[1:]}


@pytest.mark.parametrize("start", list(S))
def test_every_move_outside_the_table_is_refused(start: BatchStatus) -> None:
    record = batch(status=start)
    for to in S:
        if to in TRANSITIONS[start]:
            assert record.moved(to, 1).status is to
        else:
            with pytest.raises(TransitionError):
                record.moved(to, 1)


def test_terminal_states_have_no_way_out() -> None:
    assert {S.COMPLETED, S.FAILED, S.EXPIRED, S.CANCELLED} == TERMINAL


def test_record_round_trips_and_hides_unwritten_files() -> None:
    record = batch(status=S.IN_PROGRESS, counts=Counts(3, 1, 1), metadata={"k": "v"},
                   errors=(LineError("invalid_json_line", "bad", 7),))
    again = BatchRecord.decode(record.encode())
    assert again == record
    shown = record.to_openai()
    assert shown["object"] == "batch"
    assert shown["status"] == "in_progress"
    assert shown["request_counts"] == {"total": 3, "completed": 1, "failed": 1}
    assert shown["output_file_id"] is None
    assert shown["error_file_id"] is None
    assert shown["errors"]["data"][0] == {"code": "invalid_json_line", "message": "bad",
                                          "param": None, "line": 7}
    written = again.moved(S.CANCELLING, 5).moved(S.CANCELLED, 6, files_written=True)
    assert written.to_openai()["output_file_id"] == record.output_file_id
    assert written.to_openai()["error_file_id"] == record.error_file_id


def test_file_record_shape() -> None:
    file = FileRecord(id=new_file_id(), tenant="t", size=12, created_at=5, filename="a.jsonl",
                      purpose="batch")
    assert FileRecord.decode(file.encode()) == file
    shown = file.to_openai()
    assert shown["object"] == "file"
    assert shown["bytes"] == 12
    assert shown["status"] == "processed"


def test_ids_are_random_and_checked() -> None:
    ids = {new_file_id() for _ in range(1000)}
    assert len(ids) == 1000
    fid = ids.pop()
    assert len(fid) - len("file-") == 32  # 128 random bits, hex
    assert valid_id(fid, "file-")
    assert not valid_id(fid, "batch_")
    for bad in ("file-", "file-../../x", fid + "0", fid.upper(), "file-" + "g" * 32):
        assert not valid_id(bad, "file-")


def test_windows() -> None:
    assert parse_window("24h") == 86400
    assert parse_window("90s") == 90
    assert parse_window("5m") == 300
    for bad in ("", "24", "0h", "-1h", "1d", "1.5h", "h"):
        with pytest.raises(ValueError, match="completion_window"):
            parse_window(bad)


def test_request_ids_invert() -> None:
    bid = new_batch_id()
    rid = line_request_id(bid, 4242, 3, 2)
    assert parse_request_id(rid) == (bid, 4242, 3, 2)
    assert all(c in "0123456789abcdef-" for c in rid)
    assert line_request_id(bid, 1, 1, 1) != line_request_id(bid, 1, 2, 1)
    assert parse_request_id("0123abcd") is None


# -- lines ----------------------------------------------------------------------------


def test_splitter_numbers_physical_lines_across_chunks() -> None:
    data = b'{"a":1}\n\n{"b":2}\r\n   \n{"c":3}'
    for size in (1, 2, 3, 7, 100):
        splitter = LineSplitter(max_line=64)
        out = []
        for i in range(0, len(data), size):
            out.extend(splitter.feed(data[i:i + size]))
        out.extend(splitter.end())
        assert [n for n, _ in out] == [1, 3, 5], size
        assert [json.loads(raw) for _, raw in out] == [{"a": 1}, {"b": 2}, {"c": 3}]


def test_splitter_bounds_a_line() -> None:
    splitter = LineSplitter(max_line=10)
    assert list(splitter.feed(b"short\n")) == [(1, b"short")]
    assert list(splitter.feed(b"0123456")) == []
    with pytest.raises(LineTooLong) as err:
        list(splitter.feed(b"789abcdef"))
    assert err.value.line == 2


def _line(cid: str, url: str = "/v1/chat/completions", **extra: object) -> bytes:
    return json.dumps({"custom_id": cid, "method": "POST", "url": url,
                       "body": {"model": "m"}, **extra}).encode()


def test_validator_names_every_bad_line() -> None:
    v = LineValidator("/v1/chat/completions", max_lines=3)
    assert v.feed(1, _line("a")) is not None
    assert v.feed(2, b"{not json") is None
    assert v.feed(3, _line("a")) is None  # duplicate
    assert v.feed(4, _line("b", url="/v1/completions")) is None
    assert v.feed(5, _line("c", method="GET")) is None
    assert v.feed(6, json.dumps({"url": "/v1/chat/completions", "body": {}}).encode()) is None
    assert v.feed(7, json.dumps([1]).encode()) is None
    assert v.feed(8, _line("d")) is not None
    assert v.feed(9, _line("e")) is not None  # the fourth request: over max_lines
    got = [(e.code, e.line) for e in v.finish()]
    assert got == [("invalid_json_line", 2), ("duplicate_custom_id", 3), ("invalid_url", 4),
                   ("invalid_method", 5), ("missing_required_parameter", 6),
                   ("invalid_request", 7), ("too_many_requests", 9)]


def test_validator_rejects_an_empty_file() -> None:
    assert [e.code for e in LineValidator("/v1/completions", 10).finish()] == ["empty_file"]


def test_output_lines_are_openai_format() -> None:
    ok = json.loads(output_line("r1", "c1", 200, {"x": 1}))
    assert ok == {"id": "batch_req_r1", "custom_id": "c1", "error": None,
                  "response": {"status_code": 200, "request_id": "r1", "body": {"x": 1}}}
    err = json.loads(error_line("r2", "c2", "batch_expired", "late"))
    assert err == {"id": "batch_req_r2", "custom_id": "c2", "response": None,
                   "error": {"code": "batch_expired", "message": "late"}}


# -- one line's session --------------------------------------------------------------

LIMITS = Limits(admission_timeout=5, queue_timeout=10, lost_after=6, ack_every=2,
                max_body=100)


def test_session_collects_the_body_and_acks_chunks() -> None:
    s = LineSession("r", LIMITS, now=0)
    assert s.feed(Status(Admission.ADMITTED), 0.1) == []
    assert s.phase is Phase.ADMITTED
    assert s.feed(Head(1, "ctl.w1"), 0.2) == []
    assert s.feed(Chunk(2, b'{"a":'), 0.3) == [("ctl.w1", Ack("r", 2))]
    assert s.feed(Heartbeat(3), 0.4) == []
    assert s.feed(Chunk(4, b"1}"), 0.5) == [("ctl.w1", Ack("r", 4))]
    s.feed(Done(5, 1, 2, "stop"), 0.6)
    assert s.outcome is not None
    assert s.outcome.verdict is Verdict.OK
    assert json.loads(s.outcome.body) == {"a": 1}


def test_session_restarts_a_redelivered_job() -> None:
    s = LineSession("r", LIMITS, now=0)
    s.feed(Head(1, "ctl.w1"), 0)
    s.feed(Chunk(2, b"partial"), 0)
    # w1 died; JetStream redelivered the job to w2, which waits for the go-ahead.
    assert s.feed(Head(1, "ctl.w2", attempt=2), 1) == [("ctl.w2", Ack("r", 0))]
    s.feed(Chunk(2, b'"whole"'), 1)
    s.feed(Done(3, 0, 0, "stop"), 1)
    assert s.outcome is not None
    assert s.outcome.body == b'"whole"'


def test_a_preempted_line_waits_again_and_restarts() -> None:
    """Its worker gave the slot away (workers.preemption): a QUEUED status
    with the worker's last seq puts the line back in the queue (the queue
    timeout, from then, not the silence limit); the next Head starts it over.
    A dispatcher's QUEUED (seq 0), late, or an earlier attempt's, changes
    nothing."""
    s = LineSession("r", LIMITS, now=0)
    s.feed(Head(1, "ctl.w1"), 0)
    s.feed(Chunk(2, b"partial"), 1)
    for stale in (Status(Admission.QUEUED, 3), Status(Admission.QUEUED, seq=1)):
        assert s.feed(stale, 1) == []
        assert s.phase is Phase.RUNNING
    assert s.feed(Status(Admission.QUEUED, seq=2), 2) == []
    assert s.phase is Phase.ADMITTED
    assert s.tick(2 + LIMITS.lost_after + 1) == [], "no silent worker to wait for"
    assert s.outcome is None
    assert s.feed(Head(1 << 20, "ctl.w2", attempt=2), 11) == [("ctl.w2", Ack("r", 0))]
    s.feed(Chunk((1 << 20) + 1, b'"whole"'), 12)
    s.feed(Done((1 << 20) + 2, 0, 0, "stop"), 12)
    assert s.outcome is not None
    assert s.outcome.body == b'"whole"', "nothing of the preempted attempt"
    late = LineSession("r2", LIMITS, now=0)
    late.feed(Head(1, "ctl.w1"), 0)
    late.feed(Status(Admission.QUEUED, seq=1), 1)
    late.tick(LIMITS.queue_timeout + 0.5)  # past it from the line's start, not from 1
    assert late.outcome is None
    late.tick(1 + LIMITS.queue_timeout)
    assert late.outcome is not None
    assert late.outcome.error is not None
    assert late.outcome.error.code == "no_worker_available"


def test_a_dead_workers_job_is_handed_back_once_and_restarts() -> None:
    ack = "$JS.ACK.TG_JOBS.w.1.9.9.0.0"
    s = LineSession("r", LIMITS, now=0)
    assert s.worker_lost("ctl.w1", 0) == "", "not running yet: nothing to hand back"
    s.feed(Head(1, "ctl.w1", ack=ack), 0)
    s.feed(Chunk(2, b"partial"), 1)
    assert s.worker_lost("ctl.w2", 5) == "", "another worker's death"
    assert s.worker_lost("ctl.w1", 5) == ack  # -NAK it: redelivered now
    assert s.outcome is None
    assert s.tick(10) == [("ctl.w1", Ack("r", 2))], "the silence limit counts from 5"
    assert s.feed(Head(1, "ctl.w2", attempt=2), 11) == [("ctl.w2", Ack("r", 0))]
    s.feed(Chunk(2, b'"whole"'), 12)
    s.feed(Done(3, 0, 0, "stop"), 12)
    assert s.outcome is not None
    assert s.outcome.body == b'"whole"'
    core = LineSession("r2", LIMITS, now=0)
    core.feed(Head(1, "ctl.w1"), 0)  # no JetStream ack subject known
    assert core.worker_lost("ctl.w1", 1) == ""
    assert core.outcome is not None
    assert (core.outcome.verdict, core.outcome.error.code if core.outcome.error else "") == (
        Verdict.RETRY, "worker_lost")


@pytest.mark.parametrize(("message", "verdict"), [
    (Error(2, ErrorInfo(400, "invalid_request_error", "bad", "no")), Verdict.ERROR),
    (Error(2, ErrorInfo(502, "server_error", "backend_error", "boom")), Verdict.RETRY),
    (Chunk(3, b"x"), Verdict.RETRY),  # a gap
    (Chunk(2, b"x" * 101), Verdict.ERROR),  # over the body limit
])
def test_session_classifies_failures(message: object, verdict: Verdict) -> None:
    s = LineSession("r", LIMITS, now=0)
    s.feed(Head(1, "c"), 0)
    s.feed(message, 0)  # type: ignore[arg-type]
    assert s.outcome is not None
    assert s.outcome.verdict is verdict


def test_session_rejections_wait_or_fail() -> None:
    s = LineSession("r", LIMITS, now=0)
    s.feed(Status(Admission.REJECTED, error=ErrorInfo(429, "rate_limit_error", "rate_limit",
                                                      "slow down", True, 3.0)), 0)
    assert s.outcome is not None
    assert s.outcome.verdict is Verdict.WAIT
    assert s.outcome.retry_after == 3.0
    s = LineSession("r", LIMITS, now=0)
    s.feed(Status(Admission.REJECTED, error=ErrorInfo(429, "rate_limit_error", "too_large",
                                                      "never fits")), 0)
    assert s.outcome is not None
    assert s.outcome.verdict is Verdict.ERROR


@pytest.mark.parametrize(("steps", "code"), [
    ([], "dispatcher_unavailable"),
    ([Status(Admission.ADMITTED)], "no_worker_available"),
    ([Status(Admission.ADMITTED), Head(1, "c")], "worker_lost"),
])
def test_session_timeouts_retry(steps: list[object], code: str) -> None:
    s = LineSession("r", LIMITS, now=0)
    for m in steps:
        s.feed(m, 0)  # type: ignore[arg-type]
    now = 0.0
    while s.outcome is None and now < 20:
        now += 0.5
        s.tick(now)
    assert s.outcome is not None
    assert s.outcome.verdict is Verdict.RETRY
    assert s.outcome.error is not None
    assert s.outcome.error.code == code


def test_session_keepalive_acks_while_running() -> None:
    s = LineSession("r", LIMITS, now=0)
    s.feed(Head(1, "c"), 0)
    s.feed(Heartbeat(2), 1.9)
    assert s.tick(1.0) == []
    assert s.tick(2.0) == [("c", Ack("r", 2))]
    assert s.tick(2.5) == []


def test_batch_only_policies_apply_to_batch_requests_only() -> None:
    from tidegate.control.policies import BATCH_SCOPE, Policy, PolicySet

    tenant = Policy(tenant="acme", rpm=100)
    batch_acme = Policy(tenant="acme", model=BATCH_SCOPE, concurrency=1)
    batch_all = Policy(model=BATCH_SCOPE, tpm=1000)
    ps = PolicySet([tenant, batch_acme, batch_all])
    assert ps.applicable("acme", "gpt") == [tenant]
    assert ps.applicable("acme", "gpt", batch=True) == [tenant, batch_acme, batch_all]
    assert ps.applicable("other", "gpt", batch=True) == [batch_all]
    assert ps.applicable("other", "gpt") == []


# -- the chat route's hostile corpus, as batch lines (issue 24 item 7) ----------------

def _hostile_cases() -> list[bytes]:
    from tests.test_fuzz_edge import NASTY_BODIES
    return NASTY_BODIES


@pytest.mark.parametrize("body", _hostile_cases(), ids=lambda b: repr(b[:40]))
def test_hostile_chat_bodies_fail_as_batch_lines(body: bytes) -> None:
    """Every body the chat route rejects (tests/test_fuzz_edge.py) fails as
    a batch line's body too: at parsing (the edge's bounded parser) or at
    the body check (the edge's validation, and the wire's integer range).
    The same corpus runs through the real pipeline in
    tests/test_batch_hostile.py."""
    from dispatcher.batch.files import check_body, line_loader
    from tidegate import config as tgconfig
    from tidegate.errors import ApiError

    config = tgconfig.from_dict({"models": [
        {"name": "tidegate-sim", "aliases": ["sim"], "simulator": {}}]})
    v = LineValidator("/v1/chat/completions", 10, loads=line_loader(64))
    raw = b'{"custom_id":"h","method":"POST","url":"/v1/chat/completions","body":' + body + b"}"
    parsed = v.feed(1, raw)
    if parsed is None:
        assert [e.line for e in v.finish()] == [1]
        return
    with pytest.raises(ApiError) as err:
        check_body(parsed, "/v1/chat/completions", config.model_index())
    assert 400 <= err.value.status < 500


def test_a_line_nested_past_the_limit_is_a_line_error_not_a_recursion_error() -> None:
    from dispatcher.batch.files import line_loader

    v = LineValidator("/v1/chat/completions", 10, loads=line_loader(64))
    deep = b'{"custom_id":"d","url":"/v1/chat/completions","body":{"x":' + b"[" * 50_000 \
        + b"]" * 50_000 + b"}}"
    assert v.feed(1, deep) is None
    assert [(e.code, e.line) for e in v.finish()] == [("invalid_json_line", 1)]
