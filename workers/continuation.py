"""A redelivered job that continues what its dead first worker delivered
(the edge's side is edge/continuation.py).

The edge's go-ahead is a ``Continue`` with the text the client received; the job
runs :func:`continued` of its request: chat gets the text as a trailing
assistant message with ``continue_final_message`` (vLLM, SGLang; llama-server
continues by itself), completions the prompt plus the text, Responses the text
as a trailing assistant item; the output cap is reduced by the delivered events
(at least 1), every other field kept. :class:`ContinuedStream` drops the new
stream's role chunk, and :class:`ContinuedResponses` splices a Responses
stream's numbering, so the seam repeats nothing. Docs: docs/resume.md#continuation.
"""

from __future__ import annotations

import dataclasses
import json
import re
import time
from typing import Any

from tidegate import apis
from tidegate.control.prices import PRICE_EXTRA, cost_member
from tidegate.wire.protocol import Continue, Request
from workers.backends import BackendStream, Usage


def continued(request: Request, text: str, tokens: int) -> Request:
    """``request`` as it continues ``text`` (see the module docstring)."""
    body = dict(request.body)
    dialect = apis.of(request.api)
    dialect.continue_body(body, text)
    for key in dialect.cap_fields:
        limit = body.get(key)
        if isinstance(limit, int) and not isinstance(limit, bool):
            body[key] = max(1, limit - tokens)
    return dataclasses.replace(request, body=body)


def spent(origin: tuple[Request, str, int] | None) -> bool:
    """Whether the delivered tokens of a chat or completions stream (``origin``:
    the request before its continuation, the text, the tokens) already reach
    its own limit (``max_completion_tokens`` / ``max_tokens``): the dead
    worker sent every token and died before the last chunk. Asking the
    backend for the minimum of one token would add one past the limit;
    :class:`Closing` writes the end instead."""
    if origin is None or not apis.of(origin[0].api).choice_chunks:
        return False
    request, _, tokens = origin
    limit = apis.of(request.api).output_cap(request.body)
    return limit is not None and tokens >= limit


def closing(origin: tuple[Request, str, int] | None, go: Continue | None) -> BackendStream | None:
    """A continuation's stream when its limit is reached (:func:`spent`), else None."""
    if go is None or origin is None or not spent(origin):
        return None
    return Closing(origin[0], go.response_id)


class Closing:
    """The end of a stream whose limit its delivered tokens reached
    (:func:`spent`), without a backend call: its last chunk
    (``finish_reason: "length"``, the client's response id) and, when the
    client asked ``include_usage``, the usage chunk (its counts written by
    :class:`JoinedStream`, which wraps this as any continued stream)."""

    __slots__ = ("_data", "usage")

    def __init__(self, request: Request, response_id: str) -> None:
        chat = apis.of(request.api).openai_chat
        head = {"id": response_id, "object": "chat.completion.chunk" if chat else
                "text_completion", "created": int(time.time()), "model": request.model}
        end = ({"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"} if chat
               else {"index": 0, "text": "", "logprobs": None, "finish_reason": "length"})
        events: list[dict[str, Any]] = [{**head, "choices": [end]}]
        if request.include_usage:
            events.append({**head, "choices": [], "usage": {
                "prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}})
        self._data = b"".join(b"data: " + json.dumps(e, separators=(",", ":")).encode()
                              + b"\n\n" for e in events)
        self.usage = Usage(finish_reason="length")

    async def read(self, max_bytes: int) -> bytes:
        data, self._data = self._data, b""
        return data

    async def aclose(self) -> None:
        return None


_ID_RE = re.compile(rb'"id"\s*:\s*"([^"\\]*)"')


class ContinuedStream:
    """A backend stream whose opening role chunk (chat) is dropped, and whose
    events carry the response id the client saw (``response_id``): a real
    backend names each call's response anew (vLLM's ``chatcmpl-<uuid>``), so
    the new call's id, read from its first event, is replaced in every
    later read by a byte substitution (continued streams only)."""

    __slots__ = ("_opening", "_rename", "_response_id", "_stream")

    def __init__(self, stream: BackendStream, chat: bool, response_id: str = "") -> None:
        self._stream = stream
        self._opening = chat
        self._response_id = response_id  # "" until the new call's id is known, or none to keep
        self._rename: tuple[bytes, bytes] | None = None

    @property
    def usage(self) -> Usage:
        return self._stream.usage

    async def read(self, max_bytes: int) -> bytes:
        data = await self._stream.read(max_bytes)
        if self._response_id and data:
            found = _ID_RE.search(data)
            if found is not None:
                if found.group(1).decode(errors="replace") != self._response_id:
                    self._rename = (found.group(0),
                                    b'"id":' + json.dumps(self._response_id).encode())
                self._response_id = ""
        while self._opening and data:
            self._opening = False
            end = data.find(b"\n\n")
            if end >= 0 and b'"role"' in data[:end]:
                data = data[end + 2:]
                if not data:
                    data = await self._stream.read(max_bytes)
        if self._rename is not None:
            data = data.replace(*self._rename)
        return data

    async def aclose(self) -> None:
        await self._stream.aclose()


def continued_stream(stream: BackendStream, request: Request,
                     go: Continue) -> BackendStream:
    """The continuing backend stream as the client's goes on (see the module
    docstring). Chat and completions: its usage (the final ``include_usage``
    chunk, ``Done`` and the usage record) counts the dead worker's delivered
    events too, so the client, the quota and the usage log see one response."""
    if apis.of(request.api).numbered_events:  # Responses: its seam, not joined text
        return ContinuedResponses(stream, go, request.body.get("max_output_tokens"))
    return JoinedStream(stream, request, Usage(completion_tokens=go.tokens), go.response_id)


_USAGE_RE = re.compile(rb'"usage"\s*:\s*\{')


class JoinedStream:
    """The continuation's stream as the rest of one response: its opening
    role chunk dropped (:class:`ContinuedStream`), its usage added to what
    came before (``before``: the failed calls' prompt tokens, the completion
    events sent), and its usage event rewritten to say so; its events carry
    ``response_id``, the id the client saw, when given.

    Pull only (no ``start``): the job relays it with ``read``, a cost paid
    by continued streams alone. The usage event is found by a byte search
    per read and parsed once."""

    __slots__ = ("_before", "_cost", "_stream")

    def __init__(self, stream: BackendStream, request: Request, before: Usage,
                 response_id: str = "") -> None:
        self._stream = ContinuedStream(stream, apis.of(request.api).openai_chat, response_id)
        self._before = before
        self._cost = request.extra.get(PRICE_EXTRA)

    @property
    def usage(self) -> Usage:
        return joined(self._before, self._stream.usage)

    @property
    def call_usage(self) -> Usage:
        """The continuation call's own usage."""
        return self._stream.usage

    async def read(self, max_bytes: int) -> bytes:
        data = await self._stream.read(max_bytes)
        if _USAGE_RE.search(data) is None:
            return data
        return b"\n\n".join(self._rewrite(e) for e in data.split(b"\n\n"))

    def _rewrite(self, event: bytes) -> bytes:
        if not event.startswith(b"data:") or _USAGE_RE.search(event) is None:
            return event
        try:
            obj = json.loads(event[5:])
        except ValueError:
            return event
        if not isinstance(obj, dict) or not isinstance(obj.get("usage"), dict):
            return event
        u = self.usage
        obj["usage"].update(prompt_tokens=u.prompt_tokens, completion_tokens=u.completion_tokens,
                            total_tokens=u.prompt_tokens + u.completion_tokens)
        if "x_tidegate" in obj:  # the price extension: the cost of the whole response
            member = cost_member(self._cost, u.prompt_tokens, u.completion_tokens,
                                 u.cached_tokens)
            if member:
                obj["x_tidegate"] = json.loads(b"{" + member[1:] + b"}")["x_tidegate"]
        return b"data: " + json.dumps(obj, separators=(",", ":")).encode()

    async def aclose(self) -> None:
        await self._stream.aclose()


def joined(before: Usage, after: Usage) -> Usage:
    """One response's usage from its calls' (``before``: the calls that broke
    and the events delivered from them; ``after``: the call that goes on):
    completion tokens added, the last finish. The tenant pays for one prompt,
    the request's own: the continuing call's less the delivered text it reads
    again (events counted as tokens), or the broken calls' when no call
    followed. Every other prompt token is ``operator_prompt_tokens``: the
    operator's, in no quota, spend or usage of the tenant (docs/resume.md)."""
    total = (before.prompt_tokens + after.prompt_tokens + before.operator_prompt_tokens
             + after.operator_prompt_tokens)
    own = (after.prompt_tokens - min(before.completion_tokens, after.prompt_tokens)
           if after.prompt_tokens else before.prompt_tokens)
    return Usage(prompt_tokens=own,
                 completion_tokens=before.completion_tokens + after.completion_tokens,
                 finish_reason=after.finish_reason,
                 cached_tokens=min(before.cached_tokens + after.cached_tokens, own),
                 operator_prompt_tokens=total - own)


# The events that open a Responses stream, in OpenAI's order (the edge's
# edge/continuation.py reads the same list): ``Continue.opened`` says how far
# into it the client got.
_OPENING = (b"response.created", b"response.in_progress", b"response.output_item.added",
            b"response.content_part.added")
_CLOSING = (b"response.output_text.done", b"response.content_part.done",
            b"response.output_item.done", b"response.completed", b"response.incomplete",
            b"response.failed")
# A nested object's type is "message", "output_text", "text", ...: only the
# event's own type starts with "response.".
_TYPE = re.compile(rb'"type"\s*:\s*"(response\.[a-z_.]+)"')
_SEQ = re.compile(rb'"sequence_number"\s*:\s*\d+')
_DELTA = b'"response.output_text.delta"'
_RESPONSE_ID = re.compile(rb'"response"\s*:\s*\{\s*"id"\s*:\s*"([^"\\]+)"')
_ITEM_ID = re.compile(rb'"item"\s*:\s*\{\s*"id"\s*:\s*"([^"\\]+)"')


class ContinuedResponses:
    """A continuing backend's Responses stream, spliced onto what the client
    received (``go``, the edge's :class:`~tidegate.wire.protocol.Continue`):

    * its opening events the client already got (``go.opened`` of them, by
      type) are dropped, and their ids learnt: the new response and item ids
      are renamed to the client's in every later event (a byte replace; the
      simulator keeps its ids, a real backend names new ones);
    * every event's ``sequence_number`` goes on from ``go.events``, 1 by 1;
    * the closing events (text done, part done, item done, the terminal
      response) hold the whole text: the delivered text is put before the
      new one, the output token count grows by ``go.tokens`` and the echoed
      ``max_output_tokens`` is the client's again. Only these few events are
      parsed and encoded again; each delta only gets its number and ids.

    The job's usage (``usage``: ``Done`` and the usage record) is the whole
    response's as the client saw it: the request's own prompt tokens (the
    delivered text this call read again is the operator's, :func:`joined`)
    and every output token, the dead worker's delivered ones included."""

    __slots__ = ("_buf", "_drop", "_go", "_limit", "_next", "_renames", "_stream")

    def __init__(self, stream: BackendStream, go: Continue, limit: Any) -> None:
        self._stream = stream
        self._go = go
        self._drop = go.opened
        self._next = go.events
        # The client's max_output_tokens (the continued request's plus what was delivered).
        self._limit = limit + go.tokens if isinstance(limit, int) and go.tokens else limit
        self._renames: list[tuple[bytes, bytes]] = []
        self._buf = b""

    @property
    def usage(self) -> Usage:
        return joined(Usage(completion_tokens=self._go.tokens), self._stream.usage)

    async def read(self, max_bytes: int) -> bytes:
        while True:
            data = await self._stream.read(max_bytes)
            if not data:
                rest, self._buf = self._buf, b""
                return rest  # a cut event passes as it came, as it would have
            buf = self._buf + data if self._buf else data
            end = buf.rfind(b"\n\n")
            if end < 0:
                self._buf = buf
                continue
            self._buf = buf[end + 2:]
            out = [e for e in (self._event(ev) for ev in buf[:end].split(b"\n\n")) if e]
            if out:
                return b"".join(out)

    def _event(self, event: bytes) -> bytes:
        if not event.strip():
            return b""
        if _DELTA not in event:
            match = _TYPE.search(event)
            kind = match.group(1) if match is not None else b""
            if kind in _OPENING:
                self._learn(kind, event)
                if _OPENING.index(kind) < self._drop:
                    return b""
            elif kind in _CLOSING:
                event = self._closing(event)
        # Numbered events only: a comment (a keep-alive) takes no number.
        event, numbered = _SEQ.subn(b'"sequence_number":%d' % self._next, event, count=1)
        self._next += numbered
        for new, old in self._renames:
            event = event.replace(new, old)
        return event + b"\n\n"

    def _learn(self, kind: bytes, event: bytes) -> None:
        go = self._go
        pattern, old = ((_ITEM_ID, go.item_id) if kind == b"response.output_item.added"
                        else (_RESPONSE_ID, go.response_id))
        match = pattern.search(event)
        if match is None or not old:
            return
        pair = (b'"' + match.group(1) + b'"', b'"' + old.encode() + b'"')
        if pair[0] != pair[1] and pair not in self._renames:
            self._renames.append(pair)

    def _closing(self, event: bytes) -> bytes:
        lines = event.split(b"\n")
        data = [i for i, line in enumerate(lines) if line.startswith(b"data:")]
        if len(data) != 1:
            return event
        try:
            obj = json.loads(lines[data[0]][5:])
        except ValueError:
            return event
        if not isinstance(obj, dict):
            return event
        text, tokens = self._go.text, self._go.tokens
        if isinstance(obj.get("text"), str):  # response.output_text.done
            obj["text"] = text + obj["text"]
        _prefix_part(obj.get("part"), text)  # response.content_part.done
        _prefix_item(obj.get("item"), text)  # response.output_item.done
        response = obj.get("response")  # the terminal event
        if isinstance(response, dict):
            output = response.get("output")
            for item in output if isinstance(output, list) else ():
                if _prefix_item(item, text):
                    break
            usage = response.get("usage")
            if isinstance(usage, dict):  # as the job's usage counts it (joined)
                read_again = 0
                if isinstance(usage.get("input_tokens"), int):
                    read_again = min(tokens, usage["input_tokens"])
                    usage["input_tokens"] -= read_again
                if isinstance(usage.get("output_tokens"), int):
                    usage["output_tokens"] += tokens
                if isinstance(usage.get("total_tokens"), int):
                    usage["total_tokens"] += tokens - read_again
            if "max_output_tokens" in response:
                response["max_output_tokens"] = self._limit
        lines[data[0]] = b"data: " + json.dumps(obj, separators=(",", ":")).encode()
        return b"\n".join(lines)

    async def aclose(self) -> None:
        await self._stream.aclose()


def _prefix_part(part: Any, text: str) -> bool:
    if isinstance(part, dict) and part.get("type") == "output_text" \
            and isinstance(part.get("text"), str):
        part["text"] = text + part["text"]
        return True
    return False


def _prefix_item(item: Any, text: str) -> bool:
    """The message item's first text part starts with ``text``; False for another item."""
    if not isinstance(item, dict) or item.get("type") != "message":
        return False
    content = item.get("content")
    return any(_prefix_part(part, text) for part in (content if isinstance(content, list)
                                                      else ()))
