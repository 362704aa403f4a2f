"""Strict, bounded JSON parsing of request bodies (sans-I/O).

msgspec is the parser: it refuses everything that is not RFC 8259 JSON
(``NaN``, ``1e999``, lone surrogates, invalid UTF-8, trailing bytes) and keeps
integers exact, so one too large for the wire is refused, not rounded.

Invariants: nesting is bounded by ``max_depth`` (every refusal names the
limit), which keeps later steps far from any recursion limit; duplicate
top-level keys are refused (nested objects keep the last value, and the edge
re-encodes what it validated); the common body pays almost nothing, since the
depth walk runs only when the body has more brackets than the limit.
Docs: docs/security.md.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

from tidegate.errors import ApiError, invalid_request

_DECODER = msgspec.json.Decoder()


def parse_object(raw: bytes, max_depth: int) -> dict[str, Any]:
    """``raw`` as a JSON object, or a 400 ``invalid_json`` saying what is wrong."""
    try:
        body = _DECODER.decode(raw)
    except RecursionError:
        raise _too_deep(max_depth) from None
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise _invalid(_describe(exc)) from None
    if not isinstance(body, dict):
        raise invalid_request(
            f"The request body must be a JSON object, not {json_type(body)}.",
            code="invalid_json",
        )
    # Fewer brackets than the limit cannot nest deeper than it.
    if raw.count(b"[") + raw.count(b"{") > max_depth and _depth(body, max_depth) > max_depth:
        raise _too_deep(max_depth)
    _check_top_level_duplicates(raw, body)
    return body


def json_type(value: Any) -> str:
    """How an error message names the JSON type of ``value``."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


def _invalid(reason: str) -> ApiError:
    return invalid_request(
        f"We could not parse the JSON body of your request: {reason}. The body must be a "
        "JSON object (RFC 8259: no NaN or Infinity, numbers within range, valid UTF-8).",
        code="invalid_json",
    )


def _too_deep(max_depth: int) -> ApiError:
    return invalid_request(
        f"The JSON body is nested more than {max_depth} levels deep (the limit is "
        f"{max_depth}).", code="invalid_json")


def _describe(exc: Exception) -> str:
    message = str(exc)
    # msgspec says "Input data was truncated" for a lone surrogate escape too.
    if "out of range" in message:
        return f"{message.split(' - ')[0].lower()} (numbers must fit a 64-bit float)"
    return message.removeprefix("JSON is malformed: ").rstrip(".") or "malformed JSON"


def _depth(root: Any, limit: int) -> int:
    """Nesting depth of ``root``, iteratively; stops counting past ``limit``."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(root, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > deepest:
            deepest = depth
            if deepest > limit:
                return deepest
        if isinstance(value, dict):
            stack.extend((v, depth + 1) for v in value.values() if isinstance(v, dict | list))
        elif isinstance(value, list):
            stack.extend((v, depth + 1) for v in value if isinstance(v, dict | list))
    return deepest


def _check_top_level_duplicates(raw: bytes, body: dict[str, Any]) -> None:
    # A duplicated key leaves its quoted spelling in the raw bytes twice, unless
    # one copy is written with escapes ("mod\u0065l"); a key inside a string
    # value shows up as \"key\", which does not match. Only then is the exact,
    # slower stdlib pass needed.
    suspect = b"\\" in raw and b"\\u" in raw
    if not suspect:
        for key in body:
            if raw.count(b'"' + key.encode("utf-8", "surrogatepass") + b'"') > 1:
                suspect = True
                break
    if not suspect:
        return
    top: list[list[tuple[str, Any]]] = []

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        top.append(items)  # the top-level object is the last one closed
        return {}

    json.loads(raw, object_pairs_hook=pairs)
    seen: set[str] = set()
    for key, _value in top[-1]:
        if key in seen:
            raise invalid_request(f"The JSON body has the key {key!r} more than once; each "
                                  "top-level key may appear only once.", param=key,
                                  code="invalid_json")
        seen.add(key)
