"""Anthropic's Messages API on the wire (sans-I/O): its errors, its SSE
events and its stop reasons, shared by the edge (errors, headers) and the
workers (``workers.backends.messages_*``, which write the events).

Errors. Anthropic's error body is ``{"type": "error", "error": {"type": ...,
"message": ...}}``; tidegate's own errors (OpenAI-style ``ApiError``) map to
it by status. Where Anthropic answers 529 ``overloaded_error`` (its servers are
busy), tidegate's 503s, whose meaning is the same (queue mode's refusals, no
worker, a full request queue, a draining edge), become 529 too: the SDK
retries both, and clients written for Anthropic know 529.

Events. Each is ``event: <type>`` + ``data: <json>`` + a blank line; the SDK
skips an event without its ``event:`` line, so it is never left out.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

__all__ = ["OVERLOADED", "STOP_REASONS", "error_body", "error_event", "error_status",
           "event", "forwarded_headers", "is_messages_path"]

OVERLOADED = 529
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    402: "billing_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    504: "timeout_error",
    OVERLOADED: "overloaded_error",
}

#: chat/completions ``finish_reason`` -> Messages ``stop_reason``.
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use",
                "function_call": "tool_use", "content_filter": "refusal"}

#: Request headers a backend serving /v1/messages itself gets unchanged.
FORWARDED = ("anthropic-version", "anthropic-beta")


def is_messages_path(path: str) -> bool:
    """Whether errors on this URL path are written in Anthropic's shape."""
    return path == "/v1/messages" or path.startswith("/v1/messages/")


def error_status(status: int) -> int:
    """The status Anthropic would answer where tidegate answers ``status``."""
    return OVERLOADED if status == 503 else status


def error_body(status: int, message: str) -> tuple[int, bytes]:
    """(status, body) of an error in Anthropic's shape."""
    status = error_status(status)
    kind = _TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return status, json.dumps({"type": "error", "error": {"type": kind,
                                                          "message": message}}).encode()


def error_event(status: int, message: str) -> bytes:
    """The ``event: error`` that ends a stream which failed after it began."""
    return event(b"error", error_body(status, message)[1])


def event(kind: bytes, data: bytes) -> bytes:
    """One SSE event: its ``event:`` line, its one ``data:`` line, a blank line."""
    return b"event: " + kind + b"\ndata: " + data + b"\n\n"


def dumps(value: Any) -> bytes:
    """Compact JSON, as Anthropic's own events are written."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()


def forwarded_headers(headers: Mapping[str, str]) -> dict[str, str]:
    """The client's ``anthropic-version`` / ``anthropic-beta`` values, as sent."""
    return {name: value for name in FORWARDED if (value := headers.get(name))}
