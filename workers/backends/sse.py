"""Sans-I/O SSE passthrough: an OpenAI-compatible backend's stream in,
client-ready events out, usage and finish reason noted on the way.

Events pass byte for byte as the backend wrote them; only a few are looked
into, each found by a cheap byte search before any JSON is parsed (see
``workers.backends.openai`` for which and why).
"""

from __future__ import annotations

import json
import re
from typing import Any

from tidegate.control.prices import cost_member
from workers.backends.base import Usage
from workers.backends.upstream import broken, upstream_message

# One search finds every event worth parsing; most events match none of it.
_INTEREST_RE = re.compile(rb'"(?:usage"\s*:\s*\{|finish_reason"\s*:\s*"|error")')
_USAGE_RE = re.compile(rb'"usage"\s*:\s*\{')
_FINISH_RE = re.compile(rb'"finish_reason"\s*:\s*"')
_CONTENT_RE = re.compile(rb'"(?:content|text)"\s*:\s*"[^"]')


def lf_only(buf: bytes) -> bytes:
    """``buf`` with its ``\r\n`` and lone ``\r`` line ends as ``\n``; a
    last ``\r`` stays as it is (it may be half of a ``\r\n``)."""
    tail = b"\r" if buf.endswith(b"\r") else b""
    return buf[: len(buf) - len(tail)].replace(b"\r\n", b"\n").replace(b"\r", b"\n") + tail


class Tally:
    """What every parser of a backend's stream tells its job: whether the
    stream's end passed, how many data events came, the usage (the
    backend's own report when it sent one, else counted)."""

    __slots__ = ("done", "events", "usage", "usage_reported")

    def __init__(self, prompt_tokens: int) -> None:
        self.done = False  # the stream's end passed; later bytes are ignored
        self.events = 0  # data events seen (any), to tell "first byte" from "idle"
        self.usage = Usage(prompt_tokens=prompt_tokens)
        self.usage_reported = False  # the backend reported usage: no more counting

    @property
    def finish_reason(self) -> str:
        return self.usage.finish_reason


class EventFramer(Tally):
    """What both passthroughs share: whole SSE events out of a byte stream,
    each handed to ``_event`` (which returns it as it is, a replacement, or
    None to drop it), and the input slice itself when every event passed
    unchanged (no copy on a healthy stream)."""

    __slots__ = ("_buf",)

    def __init__(self, prompt_tokens: int) -> None:
        super().__init__(prompt_tokens)
        self._buf = b""

    def _event(self, event: bytes) -> bytes | None:
        raise NotImplementedError

    def _events(self, buf: bytes) -> bytes:
        """The events of ``buf`` (line ends normalised), keeping the
        unterminated rest for the next read."""
        *events, rest = buf.split(b"\n\n")
        self._buf = rest
        kept: list[bytes] = []
        intact = True  # every event passes unchanged: hand back the input slice as is
        for event in events:
            passed = self._event(event)
            if passed is None:
                intact = False
            else:
                intact = intact and passed is event
                kept.append(passed)
            if self.done:
                intact = False
                self._buf = b""
                break
        if intact:
            return buf[: len(buf) - len(rest)]
        return b"\n\n".join(kept) + b"\n\n" if kept else b""

    def flush(self) -> bytes:
        """End of input: treat an unterminated last event as complete (lenient)."""
        rest, self._buf = self._buf.rstrip(b"\r\n"), b""
        if not rest or self.done:
            return b""
        passed = self._event(rest)
        return passed + b"\n\n" if passed else b""


class SSEPassthrough(EventFramer):
    """Sans-I/O: upstream SSE bytes in, client-ready SSE bytes out, usage noted.

    Invariants: output is only complete events, each the upstream's own
    ``data:`` line(s) plus ``\\n\\n``; JSON is parsed only for the rare events
    that carry usage, a finish reason or an error. ``\\r\\n`` and lone ``\\r``
    line ends are normalised only when the input holds a ``\\r``.
    """

    __slots__ = ("_cost", "_include_usage", "_model", "_spliced")

    def __init__(self, *, include_usage: bool, prompt_tokens: int, model: str,
                 cost: Any = None) -> None:
        super().__init__(prompt_tokens)
        # A price spec (tidegate.control.prices.price_spec) when the client
        # asked for the cost: the usage event then gets the extension member.
        self._cost = cost
        self._spliced: bytes | None = None
        self._include_usage = include_usage
        self._model = model

    def feed(self, data: bytes) -> bytes:
        """Take upstream bytes; return the complete events to pass on (maybe ``b""``)."""
        if self.done:
            return b""
        # Fastest path, one read = one event, as a backend streaming at token
        # pace writes them: a single-line event, nothing buffered. bytes.find
        # scans with memchr; ``in`` and the general path's checks below cost
        # about twice as much per event.
        if (not self._buf and data.find(b"\n") == len(data) - 2 and data.endswith(b"\n\n")
                and data.startswith(b"data:") and data.find(b"\r") < 0
                and data.find(b"[DONE]") < 0 and _INTEREST_RE.search(data) is None):
            self.events += 1
            if not self.usage_reported and _CONTENT_RE.search(data) is not None:
                self.usage.completion_tokens += 1
            return data
        buf = self._buf + data if self._buf else data
        if b"\r" in buf:
            buf = lf_only(buf)
        end = buf.rfind(b"\n\n")
        if end < 0:
            self._buf = buf
            return b""
        # Fast path, nearly every read of a healthy stream: whole single-line
        # data events (the only newlines are the separators), none of them
        # [DONE] or of interest (usage, a finish reason, an error). They pass
        # as the input slice, scanned once per read instead of once per event.
        block = buf[:end + 2]
        n = block.count(b"\n\n")
        if (block.count(b"\n") == 2 * n and block.startswith(b"data:")
                and block.count(b"\n\ndata:") == n - 1 and b"[DONE]" not in block
                and _INTEREST_RE.search(block) is None):
            self._buf = buf[end + 2:]
            self.events += n
            if not self.usage_reported:
                if n == 1:
                    self.usage.completion_tokens += _CONTENT_RE.search(block) is not None
                else:
                    self.usage.completion_tokens += sum(
                        1 for event in block.split(b"\n\n") if _CONTENT_RE.search(event))
            return block
        return self._events(buf)

    def _event(self, event: bytes) -> bytes | None:
        """One event without its blank line: ``event`` itself when it passes
        unchanged, its ``data:`` lines when other lines were dropped, or None."""
        if event.startswith(b"data:") and b"\n" not in event:
            payload = event[6:] if event[5:6] == b" " else event[5:]
            out = event
        else:
            lines = [line for line in event.split(b"\n") if line.startswith(b"data:")]
            if not lines:
                return None  # comment, event:/id:/retry: only, or blank
            payload = b"\n".join(ln[6:] if ln[5:6] == b" " else ln[5:] for ln in lines)
            out = b"\n".join(lines)
        self.events += 1
        if payload == b"[DONE]":
            self.done = True
            return None
        if _INTEREST_RE.search(payload) is not None:
            if not self._inspect(payload):
                return None
            if self._spliced is not None:  # the usage event, with the cost member added
                out, self._spliced = b"data: " + self._spliced, None
                return out
        if not self.usage_reported and _CONTENT_RE.search(payload):
            self.usage.completion_tokens += 1
        return out

    def _inspect(self, payload: bytes) -> bool:
        """The rare events: parse once, note usage / finish reason, raise on error.

        Returns whether the event goes to the client.
        """
        keep = True
        obj: Any = None
        if b'"error"' in payload:
            obj = loads(payload)
            if isinstance(obj, dict) and obj.get("error") is not None:
                message = upstream_message(payload)
                raise broken(self._model, f"reported an error mid-stream: {message}")
        if _USAGE_RE.search(payload):
            obj = obj if obj is not None else loads(payload)
            if isinstance(obj, dict) and isinstance(obj.get("usage"), dict):
                self._record_usage(obj["usage"])
                keep = obj.get("choices") != [] or self._include_usage
                if keep and self._cost is not None:
                    u = self.usage
                    member = cost_member(self._cost, u.prompt_tokens, u.completion_tokens,
                                         u.cached_tokens)
                    end = payload.rfind(b"}")
                    if member and end > 0:
                        self._spliced = payload[:end] + member + payload[end:]
        if _FINISH_RE.search(payload):
            obj = obj if obj is not None else loads(payload)
            if isinstance(obj, dict):
                for choice in obj.get("choices") or ():
                    if isinstance(choice, dict) and isinstance(choice.get("finish_reason"), str):
                        self.usage.finish_reason = choice["finish_reason"]
                        break
        return keep

    def _record_usage(self, usage: dict[str, Any]) -> None:
        prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
        if isinstance(completion, int):
            self.usage.completion_tokens = completion
            self.usage_reported = True
        if isinstance(prompt, int):
            self.usage.prompt_tokens = prompt
        self.usage.cached_tokens = cached_tokens(usage, "prompt_tokens_details")


def cached_tokens(usage: dict[str, Any], details: str) -> int:
    """``usage[details].cached_tokens`` when the backend reports it, else 0."""
    found = usage.get(details)
    value = found.get("cached_tokens") if isinstance(found, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def loads(payload: bytes) -> Any:
    try:
        return json.loads(payload)
    except ValueError:
        return None
