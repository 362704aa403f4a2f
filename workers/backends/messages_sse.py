"""Sans-I/O streams of ``POST /v1/messages``, with the parser interface of
``workers.backends.sse.SSEPassthrough``, chosen once per job:

* :class:`MessagesTranslator`: a chat/completions stream in, Anthropic's events
  out (``message_start``, ``ping``, content blocks with ``text_delta`` or
  ``input_json_delta``, ``message_delta`` with stop reason and usage,
  ``message_stop``); every chat chunk is parsed as JSON.
* :class:`MessagesPassthrough`: a backend's own Messages stream, byte for byte
  (comments, ``id:``, ``retry:`` dropped); only ``message_start``,
  ``message_delta`` and ``error`` are parsed, found by a byte search.

Usage is counted once: the backend's final numbers replace the running count
(one token per text delta), never add to it. Docs: docs/anthropic.md#streams.
"""

from __future__ import annotations

import re
from typing import Any

from tidegate.wire.anthropic import dumps, event
from workers.backends.base import Usage
from workers.backends.messages_translate import stop_reason
from workers.backends.sse import Tally, lf_only, loads
from workers.backends.upstream import broken, upstream_message

__all__ = ["MessagesPassthrough", "MessagesTranslator", "events_of"]

_PING = event(b"ping", b'{"type":"ping"}')
_STOP = event(b"message_stop", b'{"type":"message_stop"}')
_REASONS = {"end_turn": "stop", "stop_sequence": "stop", "max_tokens": "length",
            "tool_use": "tool_calls", "refusal": "content_filter", "pause_turn": "stop"}


def events_of(buf: bytes) -> tuple[list[bytes], bytes]:
    """Complete SSE events of ``buf`` (line ends normalised) and the rest."""
    if b"\r" in buf:
        buf = lf_only(buf)
    *events, rest = buf.split(b"\n\n")
    return events, rest


def _data(event_: bytes) -> bytes | None:
    lines = [ln[6:] if ln[5:6] == b" " else ln[5:]
             for ln in event_.split(b"\n") if ln.startswith(b"data:")]
    return b"\n".join(lines) if lines else None


class MessagesTranslator(Tally):
    """Chat/completions SSE bytes in, Anthropic Messages events out."""

    __slots__ = ("_block", "_buf", "_id", "_index", "_model", "_name", "_started",
                 "_text_head", "_tools", "matched")

    def __init__(self, *, prompt_tokens: int, model: str, message_id: str,
                 client_model: str) -> None:
        super().__init__(prompt_tokens)
        self._buf = b""
        self._model = model  # for error messages: tidegate's name
        self._name = client_model  # what the client asked for, echoed in message_start
        self._id = message_id
        self._started = False
        self._index = -1  # the open content block's index (-1: none yet)
        self._block = ""  # its kind: "text", "tool" or "" (closed)
        self._tools: dict[int, int] = {}  # chat tool_call index -> content block index
        self._text_head = b""
        self.matched: Any = None  # vLLM's choice.stop_reason: the stop string matched

    def feed(self, data: bytes) -> bytes:
        if self.done:
            return b""
        events, self._buf = events_of(self._buf + data if self._buf else data)
        out: list[bytes] = []
        for raw in events:
            payload = _data(raw)
            if payload is None:
                continue
            self.events += 1
            if payload == b"[DONE]":
                out.append(self._close())
                break
            self._chunk(loads(payload), payload, out)
        return b"".join(out)

    def flush(self) -> bytes:
        """End of input: an unterminated last event counts; a stream that
        ended with a finish reason but no [DONE] still closes properly."""
        rest, self._buf = self._buf.strip(b"\r\n"), b""
        out = self.feed(rest + b"\n\n") if rest else b""
        if not self.done and self.usage.finish_reason:
            out += self._close()
        return out

    def _chunk(self, obj: Any, payload: bytes, out: list[bytes]) -> None:
        if not isinstance(obj, dict):
            return
        if obj.get("error") is not None:
            raise broken(self._model, f"reported an error mid-stream: "
                                      f"{upstream_message(payload)}")
        if not self._started:
            self._started = True
            out.append(message_start(self._id, self._name, self.usage.prompt_tokens))
            out.append(_PING)
        usage = obj.get("usage")
        if isinstance(usage, dict):
            self._record(usage)
        choices = obj.get("choices")
        choice = choices[0] if isinstance(choices, list) and choices else None
        if not isinstance(choice, dict):
            return
        delta = choice.get("delta")
        if isinstance(delta, dict):
            text = delta.get("content")
            if isinstance(text, str) and text:
                if self._block != "text":
                    self._open(out, {"type": "text", "text": ""}, "text")
                    # Per text delta only the text is encoded (the hot path).
                    self._text_head = (b'event: content_block_delta\ndata: {"type":'
                                       b'"content_block_delta","index":%d,"delta":{"type":'
                                       b'"text_delta","text":' % self._index)
                out.append(self._text_head + dumps(text) + b"}}\n\n")
                if not self.usage_reported:
                    self.usage.completion_tokens += 1
            for call in delta.get("tool_calls") or ():
                if isinstance(call, dict):
                    self._tool(call, out)
        if isinstance(choice.get("finish_reason"), str):
            self.usage.finish_reason = choice["finish_reason"]
            if isinstance(choice.get("stop_reason"), str):  # vLLM: the stop string hit
                self.matched = choice["stop_reason"]

    def _tool(self, call: dict[str, Any], out: list[bytes]) -> None:
        index, found = call.get("index"), call.get("function")
        position: int = index if isinstance(index, int) else 0
        function: dict[str, Any] = found if isinstance(found, dict) else {}
        if position not in self._tools:
            self._tools[position] = self._index + 1
            ident = call.get("id") or f"toolu_{self._id}_{position}"
            self._open(out, {"type": "tool_use", "id": ident, "name": function.get("name", ""),
                             "input": {}}, "tool")
        arguments = function.get("arguments")
        if isinstance(arguments, str) and arguments and self._tools[position] == self._index:
            out.append(event(b"content_block_delta", dumps({
                "type": "content_block_delta", "index": self._index,
                "delta": {"type": "input_json_delta", "partial_json": arguments}})))
            if not self.usage_reported:
                self.usage.completion_tokens += 1

    def _open(self, out: list[bytes], block: dict[str, Any], kind: str) -> None:
        self._end_block(out)
        self._index += 1
        self._block = kind
        out.append(event(b"content_block_start", dumps({
            "type": "content_block_start", "index": self._index, "content_block": block})))

    def _end_block(self, out: list[bytes]) -> None:
        if self._block:
            out.append(event(b"content_block_stop", b'{"type":"content_block_stop","index":%d}'
                             % self._index))
            self._block = ""

    def _close(self) -> bytes:
        """The end of the message: its last block, message_delta, message_stop."""
        self.done = True
        out: list[bytes] = []
        if not self._started:
            self._chunk({}, b"", out)
        self._end_block(out)
        finish = self.usage.finish_reason or "stop"
        self.usage.finish_reason = finish
        reason, sequence = stop_reason(finish, self.matched)
        out.append(event(b"message_delta", dumps({
            "type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
            "usage": {"input_tokens": self.usage.prompt_tokens,
                      "output_tokens": self.usage.completion_tokens}})))
        out.append(_STOP)
        return b"".join(out)

    def _record(self, usage: dict[str, Any]) -> None:
        prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
        if isinstance(prompt, int):
            self.usage.prompt_tokens = prompt
        if isinstance(completion, int):
            self.usage.completion_tokens = completion
            self.usage_reported = True


# The types worth acting on, found by one search per event; nested blocks carry
# other types ("text", "text_delta"), and a quote inside a JSON string is escaped.
_TYPE_RE = re.compile(rb'"type"\s*:\s*"(message_start|message_delta|message_stop|error|'
                      rb'content_block_delta)"')
_KEEP = (b"event:", b"data:")


def message_start(message_id: str, model: str, prompt_tokens: int) -> bytes:
    """The ``message_start`` event a stream opens with (its ``message``
    object before any content), as the translator writes it and as the
    passthrough splices it where a backend leaves it out."""
    return event(b"message_start", dumps({"type": "message_start", "message": {
        "id": message_id, "type": "message", "role": "assistant", "model": model,
        "content": [], "stop_reason": None, "stop_sequence": None,
        "usage": {"input_tokens": prompt_tokens, "output_tokens": 0}}}))


class MessagesPassthrough(Tally):
    """A backend's Messages SSE bytes in, the same bytes out, usage noted.

    One repair: a stream whose first event is not ``message_start`` gets one
    spliced in front (llama-server's /v1/messages, build 11434, starts with
    ``content_block_start``; the anthropic SDK's stream helpers then fail on
    a message they never saw begin). ``message_id`` and ``client_model`` are
    what it carries; ``None`` leaves every stream as it comes."""

    __slots__ = ("_buf", "_client_model", "_message_id", "_model")

    def __init__(self, *, prompt_tokens: int, model: str, message_id: str | None = None,
                 client_model: str = "") -> None:
        super().__init__(prompt_tokens)
        self._buf = b""
        self._model = model
        self._message_id = message_id  # None once the stream's first event passed
        self._client_model = client_model

    def feed(self, data: bytes) -> bytes:
        if self.done:
            return b""
        buf = self._buf + data if self._buf else data
        events, self._buf = events_of(buf)
        if not events:
            return b""
        kept: list[bytes] = []
        for raw in events:
            lines = raw.split(b"\n")
            if not any(ln.startswith(b"data:") for ln in lines):
                continue  # a comment, or id:/retry: only
            if not all(ln.startswith(_KEEP) for ln in lines):
                raw = b"\n".join(ln for ln in lines if ln.startswith(_KEEP))
            self.events += 1
            if self._message_id is not None:
                first = _TYPE_RE.search(raw)
                if first is None or first.group(1) != b"message_start":
                    kept.append(message_start(self._message_id, self._client_model,
                                              self.usage.prompt_tokens).removesuffix(b"\n\n"))
                self._message_id = None
            self._inspect(raw)
            kept.append(raw)
            if self.done:
                self._buf = b""
                break
        return b"\n\n".join(kept) + b"\n\n" if kept else b""

    def flush(self) -> bytes:
        rest, self._buf = self._buf.strip(b"\r\n"), b""
        return self.feed(rest + b"\n\n") if rest and not self.done else b""

    def _inspect(self, raw: bytes) -> None:
        match = _TYPE_RE.search(raw)
        if match is None:
            return
        kind = match.group(1)
        if kind == b"content_block_delta":
            if not self.usage_reported:
                self.usage.completion_tokens += 1
            return
        if kind == b"message_stop":
            self.done = True
            self.usage.finish_reason = self.usage.finish_reason or "stop"
            return
        payload = _data(raw) or b""
        obj = loads(payload)
        if kind == b"error":
            raise broken(self._model, f"reported an error mid-stream: "
                                      f"{upstream_message(payload)}")
        if not isinstance(obj, dict):
            return
        if kind == b"message_start":
            message = obj.get("message")
            record_usage(self.usage, message.get("usage") if isinstance(message, dict) else None)
            return
        delta = obj.get("delta")
        reason = delta.get("stop_reason") if isinstance(delta, dict) else None
        if isinstance(reason, str):
            self.usage.finish_reason = _REASONS.get(reason, reason)
        if record_usage(self.usage, obj.get("usage"), final=True):
            self.usage_reported = True


def record_usage(usage: Usage, reported: Any, *, final: bool = False) -> bool:
    """A Messages ``usage`` into ``usage``: input = ``input_tokens`` plus the
    cache's two counts (what the prompt cost in all); output replaces the
    running count. Whether an output count was there."""
    if not isinstance(reported, dict):
        return False
    inputs = [v for key in ("input_tokens", "cache_creation_input_tokens",
                            "cache_read_input_tokens")
              if isinstance(v := reported.get(key), int) and not isinstance(v, bool)]
    if inputs:
        usage.prompt_tokens = sum(inputs)
    output = reported.get("output_tokens")
    if isinstance(output, int) and not isinstance(output, bool):
        if final or output > usage.completion_tokens:
            usage.completion_tokens = output
        return True
    return False


def finish_of(stop: Any) -> str:
    """A Messages ``stop_reason`` as tidegate's (chat's) finish reason."""
    return _REASONS.get(stop, str(stop)) if isinstance(stop, str) else "stop"
