"""The batch API's data model, sans-I/O: files, batches, their status machine, lines.

Shared by the edge routes, the runner (``dispatcher.batch.runner``) and the CLI.

* :class:`BatchStatus` and :data:`TRANSITIONS`: the status machine as an enum
  plus a transition table; every change goes through :meth:`BatchRecord.moved`,
  which refuses a move the table does not allow and stamps its ``*_at`` time.
* :class:`FileRecord` / :class:`BatchRecord`: the KV records and their OpenAI shapes.
* :class:`LineSplitter` / :class:`LineValidator`: an input file into numbered
  lines, each checked as OpenAI does, errors naming the line.
* :func:`output_line` / :func:`error_line`: OpenAI's output file format.

Ids carry 128 random bits, so one tenant cannot guess another's.
Docs: docs/batch.md#status-machine.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass, field, replace
from enum import StrEnum
from typing import Any, TypeVar

import msgspec

from tidegate.errors import ApiError, ProtocolError, TidegateError

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/embeddings",
             "/v1/messages")
FILE_PREFIX = "file-"
BATCH_PREFIX = "batch_"
_ID = re.compile(r"(file-|batch_)[0-9a-f]{32}")
_WINDOW = re.compile(r"([1-9][0-9]*)([smh])")


def new_file_id() -> str:
    return FILE_PREFIX + secrets.token_hex(16)


def new_batch_id() -> str:
    return BATCH_PREFIX + secrets.token_hex(16)


def valid_id(value: str, prefix: str) -> bool:
    """Whether ``value`` is an id of ours with ``prefix``: checked before any
    KV lookup, so a client-chosen string never becomes a KV key."""
    return value.startswith(prefix) and _ID.fullmatch(value) is not None


def parse_window(window: str) -> float:
    """``"24h"`` -> 86400.0. OpenAI accepts only ``24h``; tidegate also takes
    ``<n>s|m|h`` (bounded by ``batch.max_window``), which short-window tests
    and operators with tighter deadlines need. ValueError otherwise."""
    match = _WINDOW.fullmatch(window)
    if match is None:
        raise ValueError(f"completion_window must look like '24h', got {window!r}")
    return int(match.group(1)) * {"s": 1, "m": 60, "h": 3600}[match.group(2)]


class BatchStatus(StrEnum):
    VALIDATING = "validating"
    FAILED = "failed"
    IN_PROGRESS = "in_progress"
    FINALIZING = "finalizing"
    COMPLETED = "completed"
    EXPIRED = "expired"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"


S = BatchStatus
TRANSITIONS: Mapping[BatchStatus, frozenset[BatchStatus]] = {
    S.VALIDATING: frozenset({S.IN_PROGRESS, S.FAILED, S.CANCELLING}),
    S.IN_PROGRESS: frozenset({S.FINALIZING, S.CANCELLING}),
    S.FINALIZING: frozenset({S.COMPLETED, S.EXPIRED, S.FAILED}),
    S.CANCELLING: frozenset({S.CANCELLED}),
    S.COMPLETED: frozenset(), S.FAILED: frozenset(), S.EXPIRED: frozenset(),
    S.CANCELLED: frozenset(),
}
TERMINAL = frozenset(s for s, nxt in TRANSITIONS.items() if not nxt)
# The timestamp each status stamps when entered (OpenAI's batch object fields).
_STAMP = {S.IN_PROGRESS: "in_progress_at", S.FINALIZING: "finalizing_at",
          S.COMPLETED: "completed_at", S.FAILED: "failed_at", S.EXPIRED: "expired_at",
          S.CANCELLING: "cancelling_at", S.CANCELLED: "cancelled_at"}


class TransitionError(TidegateError):
    """A status change the table does not allow (e.g. cancelling a completed batch)."""


@dataclass(frozen=True, slots=True)
class FileRecord:
    """One file's metadata (its bytes are object ``id`` in the object store)."""

    id: str
    tenant: str
    size: int
    created_at: int
    filename: str
    purpose: str
    expires_at: int = 0

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "object": "file", "bytes": self.size,
                "created_at": self.created_at, "filename": self.filename,
                "purpose": self.purpose, "status": "processed", "status_details": None,
                "expires_at": self.expires_at or None}

    def encode(self) -> bytes:
        return json.dumps(asdict(self), separators=(",", ":")).encode()

    @classmethod
    def decode(cls, data: bytes) -> FileRecord:
        return _decode(data, cls)


@dataclass(frozen=True, slots=True)
class LineError:
    """One entry of a failed batch's ``errors`` (OpenAI's shape)."""

    code: str
    message: str
    line: int | None = None
    param: str | None = None

    def to_openai(self) -> dict[str, Any]:
        return {"code": self.code, "message": self.message, "param": self.param,
                "line": self.line}


@dataclass(frozen=True, slots=True)
class Counts:
    total: int = 0
    completed: int = 0
    failed: int = 0  # expired lines included (OpenAI counts them as failed)
    expired: int = 0  # lines the window ended before they ran (Anthropic counts them apart)


@dataclass(frozen=True, slots=True)
class BatchRecord:
    """One batch, as the ``<P>_BATCHES`` KV bucket holds it.

    ``output_file_id`` / ``error_file_id`` are reserved at creation (so a
    runner that dies while finalizing rewrites the same objects, never a
    second set) and shown only once written (``files_written``).
    """

    id: str
    tenant: str
    endpoint: str
    input_file_id: str
    completion_window: str
    created_at: int
    expires_at: int
    output_file_id: str
    error_file_id: str
    key_id: str = ""
    user: str = ""
    status: BatchStatus = S.VALIDATING
    metadata: dict[str, str] | None = None
    counts: Counts = field(default_factory=Counts)
    errors: tuple[LineError, ...] = ()
    files_written: bool = False
    in_progress_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None

    @property
    def terminal(self) -> bool:
        return self.status in TERMINAL

    def moved(self, to: BatchStatus, now: int, **changes: Any) -> BatchRecord:
        """This batch in status ``to`` (with ``changes``); TransitionError if
        the table does not allow it."""
        if to not in TRANSITIONS[self.status]:
            raise TransitionError(f"batch {self.id} cannot go from {self.status} to {to}")
        stamp: dict[str, Any] = {_STAMP[to]: now}
        return replace(self, status=to, **stamp, **changes)

    def to_openai(self) -> dict[str, Any]:
        c = self.counts
        return {
            "id": self.id, "object": "batch", "endpoint": self.endpoint,
            "errors": ({"object": "list", "data": [e.to_openai() for e in self.errors]}
                       if self.errors else None),
            "input_file_id": self.input_file_id, "completion_window": self.completion_window,
            "status": str(self.status),
            "output_file_id": self.output_file_id if self.files_written and c.completed else None,
            "error_file_id": self.error_file_id if self.files_written and self.has_errors
            else None,
            "created_at": self.created_at, "in_progress_at": self.in_progress_at,
            "expires_at": self.expires_at, "finalizing_at": self.finalizing_at,
            "completed_at": self.completed_at, "failed_at": self.failed_at,
            "expired_at": self.expired_at, "cancelling_at": self.cancelling_at,
            "cancelled_at": self.cancelled_at,
            "request_counts": {"total": c.total, "completed": c.completed, "failed": c.failed},
            "metadata": self.metadata,
        }

    @property
    def has_errors(self) -> bool:
        """Whether the error file has lines: failed ones, or ones an expiry cut."""
        return self.counts.failed > 0 or (self.status is S.EXPIRED
                                          and self.counts.completed < self.counts.total)

    def encode(self) -> bytes:
        raw = asdict(self)
        raw["status"] = str(self.status)
        return json.dumps(raw, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, data: bytes) -> BatchRecord:
        return _decode(data, cls)


R = TypeVar("R", FileRecord, BatchRecord)


def _decode(data: bytes, cls: type[R]) -> R:
    """The record, every field of its declared type (a record with a string
    ``size`` or a numeric ``id`` is as unreadable as one that is not JSON:
    a listing sorts and sums these fields); ProtocolError otherwise. Anyone
    with the edge's NATS credentials can write these buckets."""
    try:
        return msgspec.json.decode(data, type=cls)
    except msgspec.MsgspecError as exc:
        raise ProtocolError(f"unreadable {cls.__name__}: {exc}") from None


def cancel(batch: BatchRecord, now: int) -> BatchRecord | None:
    """A cancel request applied: the batch now ``cancelling``; None when it
    already is (cancelling twice is the same cancel). TransitionError when it
    has ended or is finalizing (too late: OpenAI answers 409)."""
    if batch.status in (S.CANCELLING, S.CANCELLED):
        return None
    return batch.moved(S.CANCELLING, now)


# --------------------------------------------------------------------------
# Input lines
# --------------------------------------------------------------------------


class KeyRepeated(dict[str, Any]):
    """A parsed JSON object that had a key twice: it keeps its pairs to name
    the key (:meth:`repeated`). Made by :func:`pairs_noting_repeats`."""

    def __init__(self, items: list[tuple[str, Any]]) -> None:
        super().__init__()
        self.items_seen = items

    def repeated(self) -> str:
        seen: set[str] = set()
        for key, _ in self.items_seen:
            if key in seen:
                return key
            seen.add(key)
        return ""


def pairs_noting_repeats(items: list[tuple[str, Any]]) -> dict[str, Any]:
    """``json.loads``' ``object_pairs_hook``: a plain dict, or a
    :class:`KeyRepeated` when a key came twice (the last value wins, as in
    ``dict``)."""
    out: dict[str, Any] = KeyRepeated(items) if len({k for k, _ in items}) < len(items) else {}
    out.update(items)
    return out


class LineTooLong(TidegateError):
    def __init__(self, line: int) -> None:
        super().__init__(f"line {line} is too long")
        self.line = line


class LineSplitter:
    """Chunks in, ``(line number, bytes)`` out; numbers are 1-based physical
    lines, blank lines are skipped. Holds at most one partial line, and
    refuses (LineTooLong) one longer than ``max_line``, so memory stays
    bounded by a chunk plus a line whatever the file."""

    def __init__(self, max_line: int) -> None:
        self.max_line = max_line
        self._partial = bytearray()
        self._lineno = 0

    def feed(self, chunk: bytes) -> Iterator[tuple[int, bytes]]:
        start = 0
        while True:
            end = chunk.find(b"\n", start)
            if end < 0:
                self._partial += chunk[start:]
                if len(self._partial) > self.max_line:
                    raise LineTooLong(self._lineno + 1)
                return
            self._lineno += 1
            if self._partial:
                self._partial += chunk[start:end]
                line = bytes(self._partial)
                self._partial.clear()
            else:
                line = chunk[start:end]
            start = end + 1
            if len(line) > self.max_line:
                raise LineTooLong(self._lineno)
            if line.strip():
                yield self._lineno, line

    def end(self) -> Iterator[tuple[int, bytes]]:
        if self._partial.strip():
            self._lineno += 1
            yield self._lineno, bytes(self._partial)
        self._partial.clear()


@dataclass(frozen=True, slots=True)
class BatchLine:
    line: int
    custom_id: str
    body: dict[str, Any]


def parse_line(line: int, raw: bytes, endpoint: str,
               loads: Callable[[bytes], Any] = json.loads) -> BatchLine:
    """One input line, or the :class:`LineError` (raised as BadLine) naming it.

    ``loads`` parses the line; the runner passes the edge's bounded parser
    (``dispatcher.batch.files.line_loader``: nesting, duplicate keys), whose
    ``ApiError`` names what is wrong. A non-object line is ``invalid_request``
    whichever parser said so."""
    try:
        obj = loads(raw)
    except ApiError as error:
        if error.message.startswith("The request body must be a JSON object"):
            obj = None  # valid JSON, just not an object: reported below
        else:
            raise BadLine(LineError("invalid_json_line", f"Line {line}: {error.message}",
                                    line, error.param)) from None
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise BadLine(LineError("invalid_json_line", f"Line {line} is not valid JSON.",
                                line)) from None
    if not isinstance(obj, dict):
        raise BadLine(LineError("invalid_request", f"Line {line} is not a JSON object.", line))
    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise BadLine(LineError("missing_required_parameter",
                                f"Line {line} has no string custom_id.", line, "custom_id"))
    if obj.get("method", "POST") != "POST":
        raise BadLine(LineError("invalid_method", f"Line {line}: method must be POST.", line,
                                "method"))
    url = obj.get("url")
    if url != endpoint:
        raise BadLine(LineError("invalid_url", f"Line {line}: url {url!r} does not match the "
                                f"batch's endpoint {endpoint!r}.", line, "url"))
    body = obj.get("body")
    if not isinstance(body, dict):
        raise BadLine(LineError("invalid_request", f"Line {line}: body must be a JSON object.",
                                line, "body"))
    return BatchLine(line, custom_id, body)


class BadLine(TidegateError):
    def __init__(self, error: LineError) -> None:
        super().__init__(error.message)
        self.error = error


class LineValidator:
    """The whole-file checks: unique ``custom_id``, at most ``max_lines``
    requests. Keeps one set of custom ids (bounded by max_lines)."""

    MAX_ERRORS = 100  # a broken file reports this many, not one per line

    def __init__(self, endpoint: str, max_lines: int,
                 loads: Callable[[bytes], Any] = json.loads) -> None:
        self.endpoint = endpoint
        self.max_lines = max_lines
        self.loads = loads
        self.count = 0
        self.errors: list[LineError] = []
        self._seen: set[str] = set()

    def feed(self, line: int, raw: bytes) -> BatchLine | None:
        try:
            parsed = parse_line(line, raw, self.endpoint, self.loads)
        except BadLine as bad:
            self.error(bad.error)
            return None
        self.count += 1
        if self.count == self.max_lines + 1:
            self.error(LineError("too_many_requests", f"The file has more than "
                                 f"{self.max_lines} requests (line {line}).", line))
        if parsed.custom_id in self._seen:
            self.error(LineError("duplicate_custom_id", f"Line {line}: custom_id "
                                 f"{parsed.custom_id!r} is used by an earlier line.", line,
                                 "custom_id"))
            return None
        self._seen.add(parsed.custom_id)
        return parsed

    def error(self, error: LineError) -> None:
        if len(self.errors) < self.MAX_ERRORS:
            self.errors.append(error)

    def finish(self) -> list[LineError]:
        if not self.count and not self.errors:
            self.errors.append(LineError("empty_file", "The input file has no requests."))
        return self.errors


# --------------------------------------------------------------------------
# Output lines, request ids
# --------------------------------------------------------------------------


def output_line(request_id: str, custom_id: str, status_code: int, body: Any) -> bytes:
    """A line of the output (2xx) or error (4xx/5xx answer) file."""
    return json.dumps({"id": f"batch_req_{request_id}", "custom_id": custom_id,
                       "response": {"status_code": status_code, "request_id": request_id,
                                    "body": body},
                       "error": None}, separators=(",", ":")).encode() + b"\n"


def error_line(request_id: str, custom_id: str, code: str, message: str) -> bytes:
    """A line of the error file for a request that got no answer at all
    (``batch_expired``, ``batch_cancelled``, retries exhausted)."""
    return json.dumps({"id": f"batch_req_{request_id}", "custom_id": custom_id,
                       "response": None, "error": {"code": code, "message": message}},
                      separators=(",", ":")).encode() + b"\n"


def line_request_id(batch_id: str, line: int, epoch: int, attempt: int) -> str:
    """The request id of one attempt at one line. Deterministic, so a runner
    that republishes an attempt (publish timed out) is deduplicated by
    ``Nats-Msg-Id``; ``epoch`` (the runner's leadership term) and ``attempt``
    make every real retry a new request. Hex and dashes: a subject token, a
    KV key and a Redis key as it is."""
    return f"{batch_id.removeprefix(BATCH_PREFIX)}-{line:x}-{epoch:x}-{attempt:x}"


def parse_request_id(request_id: str) -> tuple[str, int, int, int] | None:
    """Inverse of :func:`line_request_id`; None for anything else."""
    parts = request_id.split("-")
    if len(parts) != 4:
        return None
    try:
        return BATCH_PREFIX + parts[0], int(parts[1], 16), int(parts[2], 16), int(parts[3], 16)
    except ValueError:
        return None
