"""A stream whose backend replica fails mid-stream, while its worker lives,
goes on on another replica of the model from the text already sent.

The worker-side twin of the edge's continuation, with the same rewrite
(:func:`workers.continuation.continued`). Only a job :func:`continuable` allows
(``failover = "continue"``, several replicas, one streamed chat or completions
choice, no logprobs, tools or resume) keeps a reference to each chunk it sends
(:class:`Sent`: one append, no copy); only on failure are they parsed. The
continuation opens on another replica whose breaker allows it; its role chunk
is dropped, :class:`JoinedStream` makes its usage the whole response's, and
the seq numbers simply go on. Anything else keeps its retryable error event.
Docs: docs/resume.md#a-replica-that-fails-mid-stream.
"""

from __future__ import annotations

import logging

from tidegate.apis.delivered import joined_text, text_continuable
from tidegate.errors import BackendError
from tidegate.wire.delivered import sse_events
from tidegate.wire.protocol import Api, Request
from workers.backends import Backend, BackendStream, Usage
from workers.continuation import Closing, JoinedStream, continued, spent
from workers.replicas import ReplicaSet, open_on_replicas, replica_failed, replica_failure

log = logging.getLogger("tidegate.worker")

# Mid-stream failures one job goes on after. Each continuation sends more
# text or meets a breaker, so it ends anyway; the bound keeps a response that
# breaks every replica it reaches from bouncing between them for long.
MAX_FAILURES = 3


def continuable(request: Request, failover: str) -> bool:
    """Whether ``request``'s stream can go on from its sent text on another
    replica: a model whose ``failover`` is "continue" and a request of plain
    text (``tidegate.wire.delivered.text_continuable``, the edge's rules for
    chat and completions). A resumable one too: the same job goes on, its
    seqs too, so its stream log reads as one stream."""
    return failover == "continue" and text_continuable(request)


class Sent:
    """The chunks one job sent its edge, kept for a continuation (the
    worker's ``edge.continuation.Delivered``)."""

    __slots__ = ("parts",)

    def __init__(self) -> None:
        self.parts: list[bytes] = []

    def text(self, api: Api) -> tuple[str, int, str] | None:
        """The text sent, how many content events carried it and the
        response id they carried; None when it cannot be continued (a tool
        call, several choices, an event that is not what a chat or
        completions stream sends)."""
        events = sse_events(self.parts)
        got = None if events is None else joined_text(api, events)
        if events is None or got is None:
            return None
        first = events[0].get("id") if events else None
        return (*got, first if isinstance(first, str) else "")


class Continuation:
    """One job's state on a model with several replicas: its mid-stream
    failures and, when it ``keeps`` (:func:`continuable`), what it sent and
    what the continued request starts from (the request before any
    continuation, and the text an edge's ``Continue`` already carried, with
    its event count, and the response id the client sees)."""

    __slots__ = ("base", "failures", "keeps", "prefix", "prefix_tokens", "response_id", "sent",
                 "spent")

    def __init__(self, request: Request, prefix: str = "", prefix_tokens: int = 0, *,
                 keeps: bool = True, response_id: str = "") -> None:
        self.base = request
        self.keeps = keeps
        self.prefix, self.prefix_tokens = prefix, prefix_tokens
        # The id the client's events carry: every later call's is renamed to it.
        self.response_id = response_id
        self.sent = Sent()
        # The failed calls so far: their prompt tokens and the completion
        # events this job sent from them.
        self.spent = Usage()
        self.failures = 0

    def failed(self, stream: BackendStream) -> tuple[str, int] | None:
        """``stream``'s call broke: the whole text to continue from and its
        event count (None: not continuable). Counts the call."""
        if not self.keeps:
            return None
        usage = stream.call_usage if isinstance(stream, JoinedStream) else stream.usage
        got = self.sent.text(self.base.api)
        if got is None:
            return None
        text, tokens, first_id = got
        self.response_id = self.response_id or first_id
        # Every completion event the client got before this call: an edge's
        # Continue's (its dead worker's) and this job's.
        self.spent = Usage(prompt_tokens=self.spent.prompt_tokens + usage.prompt_tokens,
                           completion_tokens=self.prefix_tokens + tokens,
                           cached_tokens=self.spent.cached_tokens + usage.cached_tokens)
        return self.prefix + text, self.prefix_tokens + tokens


async def go_on(replicas: ReplicaSet, first: str, running: str, request: Request,
                stream: BackendStream, error: BackendError, kept: Continuation, *,
                sent: bool, resumed: bool) -> tuple[BackendStream, Backend, str] | None:
    """``stream``, the call of ``request`` on replica ``running`` (the job
    pulled by replica ``first``), failed mid-stream with ``error``: the
    replica's breaker counts it, and the stream goes on on another replica
    when it can. With nothing ``sent`` yet, the request runs again (as a
    failure to open would: the edge has seen nothing); after output, a job
    that ``kept`` what it sent is continued from that text (at most
    :data:`MAX_FAILURES` times either way). Returns the
    stream that goes on, its backend and replica; None: the job ends with
    ``error``. ``resumed``: ``request`` is an edge's continuation already,
    whose rerun drops its opening role chunk too."""
    replica_failed(replicas, running, error)
    if not replica_failure(error):
        return None
    kept.failures += 1
    if kept.failures > MAX_FAILURES:
        log.info("job %s: failed mid-stream %d times; not continued again", request.id,
                 kept.failures)
        return None
    got = None
    if sent:
        got = kept.failed(stream)
        if got is None:
            return None
        if got[0] and spent((kept.base, *got)):  # every token sent: only the end is left
            log.info("job %s: replica %s failed before its last chunk; ended here",
                     request.id, running)
            return (JoinedStream(Closing(kept.base, kept.response_id), request, kept.spent,
                                 kept.response_id), replicas.backends[running], running)
        # Only the role chunk went out: the request itself, its new one dropped.
        request = continued(kept.base, *got) if got[0] else kept.base
    try:
        following, backend, name = await open_on_replicas(replicas, first, request,
                                                          failed=running, error=error)
    except BackendError as exc:
        log.info("job %s: no other replica to go on on: %s", request.id, exc.message)
        return None
    log.info("job %s: replica %s failed mid-stream (%s); %s on replica %s", request.id,
             running, error.message, "continued" if sent else "run again", name)
    if got is not None:
        return JoinedStream(following, request, kept.spent, kept.response_id), backend, name
    if resumed:  # an edge's continuation run again: its role chunk dropped, its text counted
        following = JoinedStream(following, request, Usage(completion_tokens=kept.prefix_tokens),
                                 kept.response_id)
    return following, backend, name
