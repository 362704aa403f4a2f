"""What a chat, completions or Responses stream delivered, read back from
its SSE events for a continuation (docs/resume.md, "Continuation").

Three holders keep the chunks a stream sent and read them only when it has
to go on elsewhere: the edge after its worker died (``edge/continuation.py``),
the worker after its backend replica failed (``workers/replica_continuation.py``)
and a resumable stream's log (``workers/resumable.py``). All ask the same
questions here: may this request be continued (:func:`text_continuable`,
:func:`responses_continuable`), and what did its events carry
(:func:`joined_text`; a Responses stream's seam, :func:`responses_seam`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from tidegate import apis
from tidegate.wire.protocol import Request

__all__ = ["joined_text", "responses_continuable", "responses_seam", "text_continuable"]


def text_continuable(request: Request) -> bool:
    """A streamed chat or completions request whose output is one choice of
    plain text: no ``n`` > 1, no logprobs, no tools (a half-written tool
    call's arguments cannot be continued as text), no ``echo`` (the text
    would hold the prompt). A resumable one continues from its stream log
    (workers/resumable.py), a plain one from what its edge delivered."""
    if not request.stream or not apis.of(request.api).choice_chunks:
        return False
    body = request.body
    n = body.get("n")
    return ((n is None or n == 1) and not body.get("logprobs")
            and body.get("top_logprobs") is None and not body.get("tools")
            and not body.get("functions") and body.get("echo") is not True)


def responses_continuable(request: Request) -> bool:
    """A Responses request whose output is one message of text: no tools,
    no logprobs (``top_logprobs``, ``include``: ``...logprobs``). A
    background response qualifies (it continues in its stream log)."""
    if not apis.of(request.api).numbered_events:  # the Responses API's
        return False
    body = request.body
    include = body.get("include")
    return (not body.get("tools") and not body.get("top_logprobs")
            and not (isinstance(include, list) and any("logprobs" in str(i) for i in include)))


def joined_text(api: int, events: Iterable[Any]) -> tuple[str, int] | None:
    """The text chat or completions ``events`` carried and how many content
    events carried it; None when one of them cannot be continued as text (a
    tool call, several choices, logprobs, not a chunk of this API)."""
    out: list[str] = []
    tokens = 0
    chat = apis.of(api).openai_chat
    for event in events:
        piece = _piece(chat, event)
        if piece is None:
            return None
        if piece:
            out.append(piece)
            tokens += 1
    return "".join(out), tokens


def _piece(chat: bool, event: Any) -> str | None:
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
    if not chat:  # a completions choice
        text = choice.get("text")
        return text if isinstance(text, str) else ""
    delta = choice.get("delta")
    if not isinstance(delta, Mapping) or delta.get("tool_calls") or delta.get("function_call"):
        return None
    content = delta.get("content")
    return content if isinstance(content, str) else ""


# The events that open a Responses stream of text, in OpenAI's order; a
# continuation's new stream opens the same way and the worker drops as many
# of them as the client got (workers.continuation.ContinuedResponses).
_OPENING = ("response.created", "response.in_progress", "response.output_item.added",
            "response.content_part.added")
_DELTA = "response.output_text.delta"


def responses_seam(events: Iterable[Any]) -> tuple[str, int, int, str, str, int] | None:
    """A Responses stream's seam: (text, delta events, next sequence_number,
    response id, message item id, opening events received), the fields of a
    ``Continue`` after its request id. Only one message item of
    ``output_text`` is continued: any other event (a reasoning item, a
    function call, a refusal, a closing event) makes it None."""
    out: list[str] = []
    next_seq = opened = 0
    response_id = item_id = ""
    for index, event in enumerate(events):
        if not isinstance(event, Mapping):
            return None
        kind = event.get("type")
        seq = event.get("sequence_number")
        next_seq = seq + 1 if isinstance(seq, int) and not isinstance(seq, bool) else index + 1
        if kind == _DELTA:
            delta = event.get("delta")
            if (not isinstance(delta, str) or event.get("output_index", 0) != 0
                    or event.get("content_index", 0) != 0):
                return None
            out.append(delta)
            continue
        if out or kind not in _OPENING or _OPENING.index(kind) < opened:
            return None  # not an opening event, or one out of its place
        opened = _OPENING.index(kind) + 1
        if kind == "response.output_item.added":
            item = event.get("item")
            if (not isinstance(item, Mapping) or item.get("type") != "message"
                    or event.get("output_index", 0) != 0):
                return None
            item_id = str(item.get("id") or "")
        elif kind == "response.content_part.added":
            part = event.get("part")
            if not isinstance(part, Mapping) or part.get("type") != "output_text":
                return None
        else:
            response = event.get("response")
            if isinstance(response, Mapping) and isinstance(response.get("id"), str):
                response_id = response["id"]
    return "".join(out), len(out), next_seq, response_id, item_id, opened
