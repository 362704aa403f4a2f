"""What a chat or completions stream delivered, read back from its SSE chunks
for a continuation (docs/resume.md, "Continuation").

Two holders keep the chunks a stream sent, as references, and read them only
when the stream has to go on elsewhere: the edge after its worker died
(``edge/continuation.py``) and the worker after its backend replica failed
mid-stream (``workers/replica_continuation.py``). Both ask the same two
questions here, so both answer them the same way: may this request be
continued from its text at all (:func:`text_continuable`), and what text did
its events carry (:func:`joined_text`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

from tidegate.wire.protocol import Api, Request

__all__ = ["joined_text", "sse_events", "text_continuable"]


def text_continuable(request: Request) -> bool:
    """A streamed chat or completions request whose output is one choice of
    plain text: no ``n`` > 1, no logprobs, no tools (a half-written tool
    call's arguments cannot be continued as text), no ``echo`` (the text
    would hold the prompt). A resumable one continues from its stream log
    (workers/resumable.py), a plain one from what its edge delivered."""
    if not request.stream or request.api not in (Api.CHAT, Api.COMPLETIONS):
        return False
    body = request.body
    n = body.get("n")
    return ((n is None or n == 1) and not body.get("logprobs")
            and body.get("top_logprobs") is None and not body.get("tools")
            and not body.get("functions") and body.get("echo") is not True)


def sse_events(parts: Iterable[bytes]) -> list[Any] | None:
    """The JSON events of the ``data:`` lines in ``parts`` (written SSE
    bytes), in order; ``[DONE]`` and comments skipped. None if a JSON event
    does not parse (a cut one cannot be continued)."""
    payloads: list[bytes] = []
    for line in b"".join(parts).split(b"\n"):
        if not line.startswith(b"data:"):
            continue
        payload = line[5:].lstrip(b" ")
        if payload.startswith(b"{"):
            payloads.append(payload)
    # One parse of them all as a JSON array: a third of the time of one
    # json.loads per event (the edge folds long streams with this, so it is
    # paid per chunk there). A line holding more than one value ("{..},{..}")
    # would parse as two elements: the count tells, and it is refused as a
    # parse of that line alone would be.
    try:
        events = json.loads(b"[" + b",".join(payloads) + b"]")
    except ValueError:
        return None
    return events if isinstance(events, list) and len(events) == len(payloads) else None


def joined_text(api: Api, events: Iterable[Any]) -> tuple[str, int] | None:
    """The text chat or completions ``events`` carried and how many content
    events carried it; None when one of them cannot be continued as text (a
    tool call, several choices, logprobs, not a chunk of this API)."""
    out: list[str] = []
    tokens = 0
    for event in events:
        piece = _piece(api, event)
        if piece is None:
            return None
        if piece:
            out.append(piece)
            tokens += 1
    return "".join(out), tokens


def _piece(api: Api, event: Any) -> str | None:
    """One event's text ("" for one without, such as the usage chunk)."""
    if not isinstance(event, Mapping):
        return None
    choices = event.get("choices")
    if not isinstance(choices, list):
        return None
    if not choices:
        return ""  # a usage chunk
    if len(choices) > 1 or not isinstance(choices[0], Mapping):
        return None
    choice = choices[0]
    if choice.get("index", 0) != 0 or choice.get("logprobs"):
        return None
    if api is Api.COMPLETIONS:
        text = choice.get("text")
        return text if isinstance(text, str) else ""
    delta = choice.get("delta")
    if not isinstance(delta, Mapping) or delta.get("tool_calls") or delta.get("function_call"):
        return None
    content = delta.get("content")
    return content if isinstance(content, str) else ""
