"""The contract of a model backend: the seam between a worker and whatever
generates tokens (the simulator, the OpenAI-compatible client, test fakes).

:meth:`BackendStream.read`:

* returns bytes the edge writes as they are: whole SSE events for a stream
  (never a partial event, never ``data: [DONE]``), a slice of the JSON body
  otherwise;
* returns ``b""`` exactly once, at the end; :attr:`BackendStream.usage` is then final;
* reads at most ``max_bytes`` from the backend per call (one larger event whole),
  so the flow-control window bounds what is buffered;
* raises :class:`tidegate.errors.BackendError` (from :meth:`Backend.open` before
  anything was sent). :meth:`BackendStream.aclose` closes the connection at
  once, which makes the backend abort and free its KV cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from tidegate.errors import BackendError
from tidegate.wire.protocol import Request


@dataclass(slots=True)
class Usage:
    """Token accounting for one response; final once ``read()`` returned ``b""``.

    For a cancelled stream it holds what was generated so far.
    """

    prompt_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: str = ""
    # Of prompt_tokens, those the backend served from its prefix cache
    # (usage.prompt_tokens_details.cached_tokens): priced at the cached price.
    cached_tokens: int = 0
    # Prompt tokens a continuation cost beyond the request's own prompt (the
    # delivered text read again, a broken call's prompt): the operator's,
    # outside prompt_tokens and the tenant's bill (workers.continuation.joined).
    operator_prompt_tokens: int = 0
    # A Responses API answer's id, as the backend named it (workers.owners).
    response_id: str = ""


class BackendStream(Protocol):
    @property
    def usage(self) -> Usage: ...

    async def read(self, max_bytes: int) -> bytes: ...

    async def aclose(self) -> None: ...


class Sink(Protocol):
    """Where a :class:`PushStream` delivers: in practice the worker's job.

    ``credit`` is how many bytes the sink takes in the next :meth:`data` call
    (0: none now; the stream then holds what it has, stops reading the
    backend, and waits for :meth:`PushStream.resume`). Each :meth:`data` call
    is one message of complete SSE events (or body slice), as ``read``
    returns. :meth:`end` comes once: None after the last byte, or the error
    that ended the stream. All three are called from socket callbacks and
    must not block.
    """

    def credit(self) -> int: ...

    def data(self, data: bytes) -> None: ...

    def end(self, error: BackendError | None) -> None: ...


class PushStream(BackendStream, Protocol):
    """A stream that can push into a :class:`Sink` instead of being read:
    the hot path of the worker, with no task wake-up per chunk. A stream is
    consumed one way only: either :meth:`start` or ``read``."""

    def start(self, sink: Sink) -> None: ...

    def resume(self) -> None: ...


class Backend(Protocol):
    async def open(self, request: Request) -> BackendStream: ...

    async def aclose(self) -> None: ...
