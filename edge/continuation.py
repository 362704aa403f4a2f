"""What an edge keeps of a stream so another worker can continue it when the
first one dies after output.

With ``failover = "continue"`` the edge keeps a reference to each chunk it
writes (:meth:`Delivered.add`: one append, no copy, no parse). Only when a
worker dies are they read: the text is joined (:meth:`Delivered.text`) and sent
with a Responses stream's seam to the worker that runs the redelivered job
(``Continue``). What cannot be continued (decided up front by
:func:`continuable`, or from the events: a tool call started, several choices)
ends with a retryable ``worker_lost``. Docs: docs/resume.md#continuation.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, Protocol

from edge.endings import worker_lost
from edge.session import Session
from tidegate import apis
from tidegate.apis.chat import DIALECT as CHAT
from tidegate.apis.delivered import (
    joined_text,
    responses_continuable,
    responses_seam,
    text_continuable,
)
from tidegate.config import Config, ModelConfig
from tidegate.wire import streamlog
from tidegate.wire.delivered import sse_events
from tidegate.wire.protocol import DUPLICATE_DELIVERY, Api, Cancel, Request

log = logging.getLogger("tidegate.edge")

MODES = ("continue", "restart", "off")


def continuable(request: Request, model: ModelConfig | None) -> bool:
    """Whether ``request`` can be continued from its delivered text: a model
    with ``failover = "continue"``, a streamed chat, completions or Responses
    request for one choice, without logprobs and without tools (a
    half-written tool call's arguments cannot be continued as text). A
    resumable stream (a background response's too) continues from its stream
    log: the next worker reads it and rebuilds the seam there (a Responses
    stream's sequence numbers and ids too), and its client resumes there
    (edge.relay)."""
    if model is None or model.failover != "continue" or not request.stream:
        return False
    return text_continuable(request) or responses_continuable(request)


_DECIDING = ("n", "logprobs", "top_logprobs", "tools", "functions", "echo", "background",
             "include")


def deciding_fields(body: Mapping[str, Any]) -> dict[str, Any]:
    """What :func:`continuable` reads of a body, for the relay's copy of the
    request (the edge drops the prompt once published): flags, not tools."""
    return {k: (True if k in ("tools", "functions") else body[k])
            for k in _DECIDING if body.get(k) is not None and body.get(k) != []}


# What a continuation hands the next worker: the text and the events that
# carried it, and for a Responses stream its seam (tidegate.wire.protocol.Continue).
# (Chat and completions: the text, its events and the response id.)
Seam = tuple[str, int] | tuple[str, int, int, str] | tuple[str, int, int, str, str, int]


# A chat or completions stream's kept chunks are folded into their text once
# they pass this many bytes: the edge then holds the text itself plus at most
# this much raw SSE (a chat chunk is some 150 bytes for a 4-character token:
# 30-40x its text). Below it nothing is parsed before a failover, so most
# streams never fold; a fold parses what it holds once (about 2 µs an event,
# one json.loads of them all), the same work a failover would have done.
FOLD_AT = 64 << 10


class Delivered:
    """The chunks written to one client, kept for a continuation: as written
    (references), folded into text past :data:`FOLD_AT` bytes."""

    __slots__ = ("api", "first_id", "folded", "parts", "pending", "size", "tokens", "whole")

    def __init__(self, api: Api = CHAT.api) -> None:
        self.api = api
        self.parts: list[bytes] = []
        self.size = 0  # bytes in parts
        self.folded: list[str] = []  # the text of the chunks folded so far
        self.tokens = 0  # the content events that carried it
        self.first_id: str | None = None  # the response id, once a fold saw the first event
        self.whole = True  # False: a folded chunk cannot be continued (nothing more is kept)
        self.pending = False  # its worker died; waiting for the next one's Head

    def add(self, data: bytes) -> None:
        if not self.whole:
            return
        self.parts.append(data)
        self.size += len(data)
        if self.size > FOLD_AT and apis.of(self.api).choice_chunks:
            self._fold()

    def _fold(self) -> None:
        """The kept chunks into text (a Responses stream, whose seam is more
        than text, is never folded)."""
        events = sse_events(self.parts)
        self.parts, self.size = [], 0
        got = None if events is None else joined_text(self.api, events)
        if events is None or got is None:
            self.whole = False
            return
        if self.first_id is None:
            first = events[0].get("id") if events else None
            self.first_id = first if isinstance(first, str) else ""
        self.folded.append(got[0])
        self.tokens += got[1]

    def text(self, api: Api) -> Seam | None:
        """The text the client received and how many events carried it (and,
        for Responses, the seam: ``tidegate.wire.delivered.responses_seam``);
        None when it cannot be continued (a tool call, several choices, an event that is not what a
        chat, completions or Responses stream of text sends)."""
        events = sse_events(self.parts) if self.whole else None
        if events is None:
            return None
        if apis.of(api).numbered_events:  # Responses: its seam
            return responses_seam(events)
        got = joined_text(api, events)
        if got is None:
            return None
        text, tokens = "".join(self.folded) + got[0], self.tokens + got[1]
        # The response id the client saw, which the continuing worker keeps.
        first = self.first_id if self.first_id is not None else (
            events[0].get("id") if events else None)
        return (text, tokens, 0, first) if isinstance(first, str) and first else (text, tokens)


class _Publisher(Protocol):
    async def publish(self, subject: str, payload: bytes) -> None: ...


class _Context(Protocol):
    @property
    def config(self) -> Config: ...
    @property
    def publisher(self) -> _Publisher: ...


class Relaying(Protocol):
    """What :func:`worker_gone` reads and sets of an ``edge.relay.Relay``
    (a protocol, so this module need not import the relay that imports it)."""

    last_worker_msg: float
    handed_back: bool

    @property
    def session(self) -> Session: ...
    @property
    def phase(self) -> int: ...
    @property
    def control(self) -> str: ...
    @property
    def upstream_done(self) -> bool: ...
    @property
    def wrote_chunks(self) -> bool: ...
    @property
    def failover(self) -> str: ...
    @property
    def delivered(self) -> Delivered | None: ...
    @property
    def continues_in_log(self) -> bool: ...
    @property
    def job_ack(self) -> str: ...
    @property
    def request(self) -> Request: ...
    @property
    def ctx(self) -> _Context: ...

    async def refill_log(self) -> None: ...


async def worker_gone(relay: Relaying, control: str, now: float) -> None:
    """The edge's WorkerWatch found ``relay``'s worker gone (tidegate.broker.liveness).

    ``-NAK`` the job so another worker runs it at once: with no output sent
    to the client yet (a non-streaming body is only collected so far, and is
    dropped), its Head gets the go-ahead (``failover`` "restart" or
    "continue"); after output, a continuable stream's next Head gets a
    ``Continue`` with the delivered text (a resumable stream's, an empty one:
    the worker continues the text in its log, and the client is sent to
    resume there). Anything else ends with ``worker_lost`` now rather than
    at the heartbeat limit (and ``failover = "off"`` always does)."""
    relay.session.lost = ""
    if relay.phase != 2 or control != relay.control or relay.upstream_done:
        return  # not streaming (Phase.STREAMING), another worker's, or over
    output = relay.wrote_chunks  # a non-streaming body is collected: the client has none
    if output:
        # The log first gets what the client got (a resumable stream's log
        # lags its live path): the next worker continues that text, and a
        # reader that comes later reads every event the client read.
        await relay.refill_log()
    kept = relay.delivered is not None or relay.continues_in_log
    if relay.failover == "off" or (output and (not kept or not relay.job_ack)):
        raise worker_lost()
    if relay.delivered is not None:
        relay.delivered.pending = True  # the next worker's Head gets a Continue
    relay.handed_back = True
    relay.last_worker_msg = now  # the lost-worker limit now waits for the next worker
    log.info("request %s: worker %s died %s; job handed back", relay.request.id, control,
             "mid-stream" if output else "before output")
    if relay.job_ack:
        try:
            if output and relay.continues_in_log:
                # Written first: the next worker may continue on this word if
                # this edge is gone by its Head (tidegate.wire.streamlog).
                await relay.ctx.publisher.publish(
                    streamlog.subject(relay.ctx.config.nats.subjects, relay.request.id),
                    streamlog.LogHandBack(control).encode())
            # Fencing: were the worker only cut off for a while (taken for
            # dead, yet alive), it drops its copy without a word on hearing
            # this; the stream is the next worker's now.
            await relay.ctx.publisher.publish(
                control, Cancel(relay.request.id, DUPLICATE_DELIVERY).encode())
            await relay.ctx.publisher.publish(relay.job_ack, b"-NAK")
        except Exception as exc:  # redelivery after worker.ack_wait remains
            log.warning("could not hand back the job of %s: %s", relay.request.id, exc)
