"""Anthropic Message Batches on the runner's records, sans-I/O
(``tidegate.wire.message_batch``): ids, the create body into the runner's
input lines, the record as a ``message_batch``, result lines."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import pytest

from tidegate.errors import ApiError, invalid_request
from tidegate.wire import message_batch as mb
from tidegate.wire.batch import (
    BatchRecord,
    BatchStatus,
    Counts,
    LineValidator,
    error_line,
    output_line,
)

S = BatchStatus
PARAMS = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
HEX = "0123456789abcdef" * 2


def ok(params: dict[str, Any]) -> None:
    if "bad" in params:
        raise invalid_request("bad: not allowed.", param="bad")


def lines_of(body: Any, max_lines: int = 10, max_line: int = 4096) -> list[bytes]:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return mb.input_lines(raw, json.loads(raw), max_lines, max_line, ok)


def test_ids() -> None:
    assert mb.public_id("batch_" + HEX) == "msgbatch_" + HEX
    assert mb.batch_id("msgbatch_" + HEX) == "batch_" + HEX
    for bad in ("batch_" + HEX, "msgbatch_" + HEX.upper(), "msgbatch_" + HEX + "0",
                "msgbatch_", "msgbatch_../" + HEX[3:], "msgbatch_" + HEX[:-1] + ">", ""):
        assert mb.batch_id(bad) is None, bad


def test_lines_are_what_the_runner_reads() -> None:
    body = {"requests": [{"custom_id": f"r-{i}", "params": {**PARAMS, "stream": True}}
                         for i in range(3)]}
    lines = lines_of(body)
    validator = LineValidator(mb.ENDPOINT, 10)
    parsed = [validator.feed(i + 1, line.rstrip(b"\n")) for i, line in enumerate(lines)]
    assert validator.finish() == []
    assert [p.custom_id for p in parsed if p] == ["r-0", "r-1", "r-2"]
    assert all(p and p.body == PARAMS for p in parsed)  # stream dropped: a result is one body


@pytest.mark.parametrize(("body", "param", "code"), [
    ({}, "requests", None),
    ({"requests": []}, "requests", None),
    ({"requests": {"custom_id": "a"}}, "requests", None),
    ({"requests": [{"custom_id": str(i), "params": PARAMS} for i in range(11)]}, "requests",
     "too_many_requests"),
    ({"requests": [1]}, "requests[0]", None),
    ({"requests": [{"params": PARAMS}]}, "requests[0].custom_id", None),
    ({"requests": [{"custom_id": "", "params": PARAMS}]}, "requests[0].custom_id", None),
    ({"requests": [{"custom_id": "a" * 65, "params": PARAMS}]}, "requests[0].custom_id", None),
    ({"requests": [{"custom_id": "a b", "params": PARAMS}]}, "requests[0].custom_id", None),
    ({"requests": [{"custom_id": "a.b", "params": PARAMS}]}, "requests[0].custom_id", None),
    ({"requests": [{"custom_id": 7, "params": PARAMS}]}, "requests[0].custom_id", None),
    ({"requests": [{"custom_id": "a", "params": PARAMS}, {"custom_id": "a", "params": PARAMS}]},
     "requests[1].custom_id", "duplicate_custom_id"),
    ({"requests": [{"custom_id": "a"}]}, "requests[0].params", None),
    ({"requests": [{"custom_id": "a", "params": [PARAMS]}]}, "requests[0].params", None),
    ({"requests": [{"custom_id": "a", "params": {**PARAMS, "bad": 1}}]},
     "requests[0].params.bad", None),
    ({"requests": [{"custom_id": "a", "params": {**PARAMS, "system": "x" * 5000}}]},
     "requests[0]", "request_too_large"),
])
def test_refused(body: dict[str, Any], param: str, code: str | None) -> None:
    with pytest.raises(ApiError) as caught:
        lines_of(body)
    assert caught.value.status == 400
    assert caught.value.param == param
    assert caught.value.message.startswith(param.split(".")[0].split("[")[0])
    if code:
        assert caught.value.code == code


@pytest.mark.parametrize(("raw", "param"), [
    (b'{"requests":[{"custom_id":"a","custom_id":"b","params":{"model":"m"}}]}',
     "requests[0]"),
    (b'{"requests":[{"custom_id":"a","params":{"model":"m","model":"n"}}]}',
     "requests[0].params"),
    (b'{"requests":[{"custom_id":"a","params":{"model":"m"}},'
     b'{"custom_id":"b","params":{"model":"m","mod\\u0065l":"n"}}]}', "requests[1].params"),
])
def test_a_key_twice_is_refused(raw: bytes, param: str) -> None:
    with pytest.raises(ApiError) as caught:
        mb.input_lines(raw, json.loads(raw), 10, 4096, lambda _: None)
    assert caught.value.param == param
    assert caught.value.code == "invalid_json"


def test_a_key_in_a_string_is_no_duplicate() -> None:
    params = {**PARAMS, "system": 'say "model" and "custom_id"'}
    assert len(lines_of({"requests": [{"custom_id": "a", "params": params}]})) == 1


RECORD = BatchRecord(id="batch_" + HEX, tenant="t", endpoint=mb.ENDPOINT, input_file_id="f",
                     completion_window="86400s", created_at=1_000, expires_at=1_000 + 86400,
                     output_file_id="o", error_file_id="e", counts=Counts(total=10))
DAY = 86400.0


def view(record: BatchRecord, now: float = 2_000, retention: float = 30 * DAY) -> Any:
    return mb.batch_object(record, now, retention, "http://x/results")


@pytest.mark.parametrize(("status", "shown"), [
    (S.VALIDATING, "in_progress"), (S.IN_PROGRESS, "in_progress"),
    (S.FINALIZING, "in_progress"), (S.CANCELLING, "canceling"), (S.COMPLETED, "ended"),
    (S.EXPIRED, "ended"), (S.CANCELLED, "ended"), (S.FAILED, "ended")])
def test_processing_status(status: BatchStatus, shown: str) -> None:
    obj = view(replace(RECORD, status=status, counts=Counts(10, 3, 1)))
    assert obj["processing_status"] == shown
    assert (obj["results_url"] is not None) == (shown == "ended")
    assert sum(obj["request_counts"].values()) == 10
    if shown != "ended":  # Anthropic's counts say nothing before the end
        assert obj["request_counts"]["processing"] == 10
        assert obj["ended_at"] is None


def test_counts_at_the_end() -> None:
    def counts(status: BatchStatus, c: Counts) -> Any:
        return view(replace(RECORD, status=status, counts=c, completed_at=1_500,
                            expired_at=1_500, cancelled_at=1_500,
                            failed_at=1_500))["request_counts"]
    assert counts(S.COMPLETED, Counts(10, 8, 2)) == {
        "processing": 0, "succeeded": 8, "errored": 2, "canceled": 0, "expired": 0}
    assert counts(S.EXPIRED, Counts(10, 5, 5, 3)) == {  # failed: errored and expired
        "processing": 0, "succeeded": 5, "errored": 2, "canceled": 0, "expired": 3}
    assert counts(S.CANCELLED, Counts(10, 4, 1)) == {
        "processing": 0, "succeeded": 4, "errored": 1, "canceled": 5, "expired": 0}
    assert counts(S.FAILED, Counts(10)) == {
        "processing": 0, "succeeded": 0, "errored": 10, "canceled": 0, "expired": 0}


def test_times_and_results_expiry() -> None:
    ended = replace(RECORD, status=S.CANCELLED, cancelling_at=1_200, cancelled_at=1_300)
    obj = view(ended)
    assert obj["created_at"] == "1970-01-01T00:16:40Z"
    assert obj["expires_at"] == "1970-01-02T00:16:40Z"
    assert obj["cancel_initiated_at"] == "1970-01-01T00:20:00Z"
    assert obj["ended_at"] == "1970-01-01T00:21:40Z"
    assert obj["archived_at"] is None
    assert obj["results_url"] == "http://x/results"
    # Results are kept batch.file_ttl from creation, as the runner's files are.
    gone = view(ended, now=1_000 + DAY, retention=DAY)
    assert gone["archived_at"] == "1970-01-02T00:16:40Z"
    assert gone["results_url"] is None
    assert mb.archived(ended, 1_000 + DAY, DAY)
    assert not mb.archived(ended, 1_000 + DAY - 1, DAY)


def test_result_lines() -> None:
    message = {"id": "msg_1", "type": "message", "content": [{"type": "text", "text": "x"}]}
    cid, line = mb.result_line(output_line("r1", "a", 200, message))
    assert cid == "a"
    assert json.loads(line) == {"custom_id": "a",
                                "result": {"type": "succeeded", "message": message}}
    _, line = mb.result_line(output_line("r2", "b", 429, {"error": {
        "message": "slow down", "type": "rate_limit_error", "code": None}}))
    assert json.loads(line)["result"] == {"type": "errored", "error": {
        "type": "error", "error": {"type": "rate_limit_error", "message": "slow down"},
        "request_id": "r2"}}
    _, line = mb.result_line(output_line("r3", "c", 503, {"error": {"message": "busy"}}))
    assert json.loads(line)["result"]["error"]["error"]["type"] == "overloaded_error"
    _, line = mb.result_line(error_line("r4", "d", "batch_expired", "too late"))
    assert json.loads(line) == {"custom_id": "d", "result": {"type": "expired"}}
    _, line = mb.result_line(error_line("r5", "e", "worker_lost", "lost"))
    result = json.loads(line)["result"]
    assert result["type"] == "errored"
    assert result["error"]["error"] == {"type": "api_error", "message": "lost"}
    assert json.loads(mb.canceled_line("f")) == {"custom_id": "f",
                                                 "result": {"type": "canceled"}}
