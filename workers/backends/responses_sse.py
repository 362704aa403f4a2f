"""Sans-I/O passthrough of a Responses API stream: the backend's typed SSE events
in, client-ready events out (the interface of ``workers.backends.sse.SSEPassthrough``).

Invariants: events pass byte for byte (only comments, ``id:`` and ``retry:``
dropped); a missing ``sequence_number`` (llama-server) is spliced in as the
event's 0-based index, never by re-encoding the JSON; usage comes from the
terminal event, the only one parsed, and until then each text delta counts one
token; the terminal event ends the stream and anything after it (a
``data: [DONE]``) is dropped; a top-level ``error`` event becomes a
:class:`tidegate.errors.BackendError`. Docs: docs/backends.md.
"""

from __future__ import annotations

import re
from typing import Any

from workers.backends.base import Usage
from workers.backends.sse import EventFramer, cached_tokens, lf_only, loads
from workers.backends.upstream import broken

__all__ = ["ResponsesPassthrough"]

# One search per event finds the types worth acting on; nested objects carry
# other types ("message", "output_text"), and a quote inside a JSON string is
# escaped, so only a real top-level-or-item type matches.
_TYPE_RE = re.compile(rb'"type"\s*:\s*"(response\.output_text\.delta|response\.completed|'
                      rb'response\.incomplete|response\.failed|error)"')
_SEQ = b'"sequence_number"'
_ID_RE = re.compile(rb'"response"\s*:\s*\{\s*"id"\s*:\s*"([^"\\]+)"')
_DELTA = b"response.output_text.delta"
_KEEP = (b"event:", b"data:")
_FINISH = {"completed": "stop", "max_output_tokens": "length", "content_filter":
           "content_filter", "failed": "error"}


class ResponsesPassthrough(EventFramer):
    """Upstream Responses SSE bytes in, client-ready SSE bytes out, usage noted."""

    __slots__ = ("_backend_id", "_model", "_rename", "spliced")

    def __init__(self, *, prompt_tokens: int, model: str, rename: bytes | None = None) -> None:
        super().__init__(prompt_tokens)
        self._model = model
        # A background response (edge.background): the backend's response id
        # becomes tidegate's in every event, so clients retrieve by it.
        self._rename = rename
        self._backend_id: bytes | None = None
        # self.events (data events seen) is also the next missing sequence_number.
        self.spliced = 0  # events that got a sequence_number from us

    def feed(self, data: bytes) -> bytes:
        """Take upstream bytes; return the complete events to pass on (maybe ``b""``)."""
        if self.done:
            return b""
        buf = self._buf + data if self._buf else data
        if b"\r" in buf:
            buf = lf_only(buf)
        return self._events(buf)

    def _event(self, event: bytes) -> bytes | None:
        """One event without its blank line: ``event`` itself when it passes
        unchanged, a new byte string when lines were dropped or a
        sequence_number spliced in, or None when nothing of it goes on."""
        lines = event.split(b"\n")
        data = [ln for ln in lines if ln.startswith(b"data:")]
        if not data:
            return None  # comment, event:/id:/retry: only, or blank
        out = event
        if len(data) + sum(1 for ln in lines if ln.startswith(b"event:")) != len(lines):
            out = b"\n".join(ln for ln in lines if ln.startswith(_KEEP))
        payload = (data[0][6:] if data[0][5:6] == b" " else data[0][5:]) if len(data) == 1 \
            else b"\n".join(ln[6:] if ln[5:6] == b" " else ln[5:] for ln in data)
        if payload == b"[DONE]":
            self.done = True
            return None
        index = self.events
        self.events += 1
        match = _TYPE_RE.search(payload)
        if match is not None:
            kind = match.group(1)
            if kind == _DELTA:
                if not self.usage_reported:
                    self.usage.completion_tokens += 1
            elif kind == b"error":
                raise broken(self._model, f"reported an error mid-stream: {_message(payload)}")
            else:
                self._terminal(payload)
        if _SEQ not in payload:
            out = _splice(out, index)
            self.spliced += 1
        if self._rename is not None:
            out = self._renamed(out, payload)
        return out

    def _renamed(self, out: bytes, payload: bytes) -> bytes:
        if self._backend_id is None:
            match = _ID_RE.search(payload)
            if match is None:
                return out
            self._backend_id = b'"' + match.group(1) + b'"'
        assert self._rename is not None
        return out.replace(self._backend_id, b'"' + self._rename + b'"')

    def _terminal(self, payload: bytes) -> None:
        """response.completed / incomplete / failed: the final usage, and the end."""
        self.done = True
        obj = loads(payload)
        response = obj.get("response") if isinstance(obj, dict) else None
        if not isinstance(response, dict):
            self.usage.finish_reason = "stop"
            return
        status = response.get("status")
        details = response.get("incomplete_details")
        reason = details.get("reason") if isinstance(details, dict) else None
        key = reason if isinstance(reason, str) else status if isinstance(status, str) else ""
        self.usage.finish_reason = _FINISH.get(key, key or "stop")
        record_usage(self.usage, response)
        self.usage_reported = True


def record_usage(usage: Usage, response: dict[str, Any]) -> None:
    """A Responses response object's id and ``usage`` (``input_tokens`` /
    ``output_tokens``) into ``usage``."""
    rid = response.get("id")
    if isinstance(rid, str):
        usage.response_id = rid
    reported = response.get("usage")
    if not isinstance(reported, dict):
        return
    prompt, completion = reported.get("input_tokens"), reported.get("output_tokens")
    if isinstance(prompt, int) and not isinstance(prompt, bool):
        usage.prompt_tokens = prompt
    if isinstance(completion, int) and not isinstance(completion, bool):
        usage.completion_tokens = completion
    usage.cached_tokens = cached_tokens(reported, "input_tokens_details")


def _splice(event: bytes, seq: int) -> bytes:
    """``event`` with ``"sequence_number":seq`` inserted as the first member of
    its (first) data line's JSON object; unchanged when that is no object."""
    start = 0 if event.startswith(b"data:") else event.find(b"\ndata:") + 1
    if start == 0 and not event.startswith(b"data:"):
        return event
    brace = start + 5
    while brace < len(event) and event[brace] in b" \t":
        brace += 1
    if brace >= len(event) or event[brace] != 0x7B:  # "{"
        return event
    after = brace + 1
    while after < len(event) and event[after] in b" \t\n":
        after += 1
    member = b'"sequence_number":%d' % seq
    if after < len(event) and event[after] == 0x7D:  # "}": an empty object
        return event[:brace + 1] + member + event[brace + 1:]
    return event[:brace + 1] + member + b"," + event[brace + 1:]


def _message(payload: bytes) -> str:
    obj = loads(payload)
    if isinstance(obj, dict):
        for where in (obj, obj.get("error")):
            if isinstance(where, dict) and isinstance(where.get("message"), str):
                return str(where["message"])
    return payload[:200].decode("utf-8", "replace")
