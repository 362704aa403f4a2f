"""Anthropic's Message Batches on the batch runner's records, sans-I/O.

An Anthropic batch is a :class:`~tidegate.wire.batch.BatchRecord` of endpoint
``/v1/messages`` seen through Anthropic's shapes: ``msgbatch_<hex>`` is
``batch_<hex>``; the ``requests`` become the runner's JSONL input lines
(:func:`input_lines`); the record becomes a ``message_batch`` object
(:func:`batch_object`); output and error file lines become result lines
(:func:`result_line`), and a request a cancel left unrun a ``canceled`` one.
The routes are ``edge.message_batches``; docs/batch.md#anthropic-message-batches.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from tidegate.errors import ApiError, invalid_request
from tidegate.wire import anthropic
from tidegate.wire.batch import (
    BATCH_PREFIX,
    BatchRecord,
    BatchStatus,
    KeyRepeated,
    pairs_noting_repeats,
    valid_id,
)

ENDPOINT = "/v1/messages"
PREFIX = "msgbatch_"
_CUSTOM_ID = re.compile(r"[a-zA-Z0-9_-]{1,64}")  # Anthropic's pattern for custom_id
S = BatchStatus
_STATUS = {S.VALIDATING: "in_progress", S.IN_PROGRESS: "in_progress",
           S.FINALIZING: "in_progress", S.CANCELLING: "canceling"}  # the rest: "ended"

__all__ = ["ENDPOINT", "PREFIX", "batch_id", "batch_object", "canceled_line",
           "errored_line", "input_lines", "public_id", "result_line"]


def public_id(record_id: str) -> str:
    return PREFIX + record_id.removeprefix(BATCH_PREFIX)


def batch_id(message_batch_id: str) -> str | None:
    """The record id of ``msgbatch_<hex>``; None for anything else (a
    client-chosen string never becomes a KV key)."""
    record_id = BATCH_PREFIX + message_batch_id.removeprefix(PREFIX)
    ok = message_batch_id.startswith(PREFIX) and valid_id(record_id, BATCH_PREFIX)
    return record_id if ok else None


def input_lines(raw: bytes, body: dict[str, Any], max_lines: int, max_line_bytes: int,
                check: Callable[[dict[str, Any]], None]) -> list[bytes]:
    """The runner's input lines for a create body ``{"requests": [...]}``
    (``raw``, parsed as ``body``); an ApiError (400, Anthropic's pattern for
    ``custom_id``, unique ids, at most ``max_lines`` requests, each line at
    most ``max_line_bytes``, no key twice in a request or its params, as a
    ``POST /v1/messages`` body may not have one) naming the request
    otherwise. ``check`` validates one request's ``params`` as ``POST
    /v1/messages`` does and raises its ApiError, named ``requests[i].params``
    here."""
    requests = body.get("requests")
    if not isinstance(requests, list) or not requests:
        raise invalid_request("requests: must be a non-empty array of {custom_id, params}.",
                              param="requests")
    if len(requests) > max_lines:
        raise invalid_request(f"requests: at most {max_lines} requests per batch, got "
                              f"{len(requests)}.", param="requests", code="too_many_requests")
    _no_duplicate_keys(raw, requests)
    seen: dict[str, int] = {}
    lines = []
    for i, item in enumerate(requests):
        where = f"requests[{i}]"
        if not isinstance(item, dict):
            raise invalid_request(f"{where}: must be an object with custom_id and params.",
                                  param=where)
        custom_id = item.get("custom_id")
        if not isinstance(custom_id, str) or not _CUSTOM_ID.fullmatch(custom_id):
            raise invalid_request(f"{where}.custom_id: must be 1 to 64 letters, digits, '_' "
                                  f"or '-'.", param=f"{where}.custom_id")
        if custom_id in seen:
            raise invalid_request(f"{where}.custom_id: {custom_id!r} is the custom_id of "
                                  f"requests[{seen[custom_id]}] too; each must be unique.",
                                  param=f"{where}.custom_id", code="duplicate_custom_id")
        seen[custom_id] = i
        params = item.get("params")
        if not isinstance(params, dict):
            raise invalid_request(f"{where}.params: must be a Messages request object.",
                                  param=f"{where}.params")
        # A result is one Message, not a stream (the runner drops it too).
        params = {k: v for k, v in params.items() if k != "stream"}
        try:
            check(params)
        except ApiError as error:
            param = f"{where}.params" + (f".{error.param}" if error.param else "")
            raise invalid_request(f"{where}.params: {error.message}", param=param,
                                  code=error.code or "invalid_request") from None
        line = json.dumps({"custom_id": custom_id, "method": "POST", "url": ENDPOINT,
                           "body": params}, separators=(",", ":"),
                          ensure_ascii=False).encode() + b"\n"
        if len(line) > max_line_bytes:
            raise invalid_request(f"{where}: {len(line)} bytes, more than the limit of "
                                  f"{max_line_bytes} per request.", param=where,
                                  code="request_too_large")
        lines.append(line)
    return lines


def _no_duplicate_keys(raw: bytes, requests: list[Any]) -> None:
    """No request object and no ``params`` with a key twice. The exact
    stdlib pass runs only when the cheap test fails: a key written more
    often in ``raw`` than the parsed objects hold it, or an escape that
    could spell one ("mod\\u0065l")."""
    objects = [o for item in requests if isinstance(item, dict)
               for o in (item, item.get("params")) if isinstance(o, dict)]
    uses: dict[str, int] = {}
    for obj in objects:
        for key in obj:
            uses[key] = uses.get(key, 0) + 1
    if b"\\u" not in raw and all(
            raw.count(b'"' + k.encode("utf-8", "surrogatepass") + b'"') <= n
            for k, n in uses.items()):
        return

    top = json.loads(raw, object_pairs_hook=pairs_noting_repeats)
    items = top.get("requests") if isinstance(top, dict) else None
    for i, item in enumerate(items if isinstance(items, list) else []):
        params = item.get("params") if isinstance(item, dict) else None
        for where, value in ((f"requests[{i}]", item), (f"requests[{i}].params", params)):
            if isinstance(value, KeyRepeated):
                raise invalid_request(f"{where}: has the key {value.repeated()!r} more than once; "
                                      "each key may appear only once.", param=where,
                                      code="invalid_json")


def _time(ts: int | None) -> str | None:
    if ts is None:
        return None
    return datetime.fromtimestamp(ts, UTC).isoformat().replace("+00:00", "Z")


def ended_at(record: BatchRecord) -> int | None:
    return (record.completed_at or record.expired_at or record.cancelled_at
            or record.failed_at) if record.terminal else None


def archived(record: BatchRecord, now: float, retention: float) -> bool:
    """Whether its results have aged out: kept ``retention`` seconds from
    creation (``batch.file_ttl``), as the runner's files are."""
    return now >= record.created_at + retention


def batch_object(record: BatchRecord, now: float, retention: float,
                 results_url: str) -> dict[str, Any]:
    """The ``message_batch`` object. Counts other than ``processing`` stay 0
    until the batch has ended, as Anthropic's do."""
    status = _STATUS.get(record.status, "ended")
    c = record.counts
    counts = {"processing": c.total, "succeeded": 0, "errored": 0, "canceled": 0,
              "expired": 0}
    if status == "ended":
        if record.status is S.FAILED:  # refused at validation: no request ran
            counts.update(processing=0, errored=c.total)
        else:
            counts.update(processing=0, succeeded=c.completed,
                          errored=max(0, c.failed - c.expired), expired=c.expired,
                          canceled=max(0, c.total - c.completed - c.failed))
    gone = archived(record, now, retention)
    return {"id": public_id(record.id), "type": "message_batch",
            "processing_status": status, "request_counts": counts,
            "ended_at": _time(ended_at(record)), "created_at": _time(record.created_at),
            "expires_at": _time(record.expires_at),
            "archived_at": _time(int(record.created_at + retention)) if gone else None,
            "cancel_initiated_at": _time(record.cancelling_at),
            "results_url": results_url if status == "ended" and not gone else None}


def _dumps(value: Any) -> bytes:
    return anthropic.dumps(value) + b"\n"


def _error(status: int, message: str, request_id: str | None) -> dict[str, Any]:
    error: dict[str, Any] = json.loads(anthropic.error_body(status, message)[1])
    error["request_id"] = request_id
    return error


def errored_line(custom_id: str, status: int, message: str,
                 request_id: str | None = None) -> bytes:
    return _dumps({"custom_id": custom_id, "result": {
        "type": "errored", "error": _error(status, message, request_id)}})


def canceled_line(custom_id: str) -> bytes:
    return _dumps({"custom_id": custom_id, "result": {"type": "canceled"}})


def result_line(raw: bytes) -> tuple[str, bytes]:
    """(custom_id, the result line) of a line of the runner's output or
    error file (``tidegate.wire.batch.output_line`` / ``error_line``): a
    2xx Messages body ``succeeded``, ``batch_expired`` ``expired``, any
    other answer ``errored`` with the error in Anthropic's shape."""
    line = json.loads(raw)
    custom_id = str(line["custom_id"])
    response, rid = line.get("response"), None
    if isinstance(response, dict):
        status, body, rid = response.get("status_code"), response.get("body"), \
            response.get("request_id")
        if isinstance(status, int) and 200 <= status < 300 and isinstance(body, dict):
            return custom_id, _dumps({"custom_id": custom_id,
                                      "result": {"type": "succeeded", "message": body}})
        return custom_id, errored_line(custom_id, status if isinstance(status, int) else 502,
                                       _message(body), rid)
    error = line.get("error") or {}
    if error.get("code") == "batch_expired":
        return custom_id, _dumps({"custom_id": custom_id, "result": {"type": "expired"}})
    return custom_id, errored_line(custom_id, 500, str(error.get("message") or
                                                       "The request failed."))


def _message(body: Any) -> str:
    """The message of an error body in OpenAI's or Anthropic's shape."""
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        return str(body["error"].get("message") or "The request failed.")
    return str(body)[:1000] if body else "The request failed."
