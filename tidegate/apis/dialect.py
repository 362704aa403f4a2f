"""What every API dialect answers: :class:`Dialect`, the base of the five
(``tidegate.apis.chat``, ``completions``, ``responses``, ``embeddings``,
``messages``). Code outside ``tidegate.apis`` asks a request's dialect
(``tidegate.apis.of(request.api)``) instead of comparing ``Api`` members.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, ClassVar

from tidegate.config import ModelConfig
from tidegate.validation.generation import DEFAULT_MAX_DEPTH, Validated, parse_json
from tidegate.validation.responses import DEFAULT_MAX_RESPONSE_BYTES
from tidegate.wire.protocol import Api
from tidegate.wire.tokens import as_int, choice_count


class Dialect:
    """One API's knowledge. Subclasses set the class attributes and override
    what differs; each module holds one instance, ``DIALECT``."""

    api: ClassVar[Api]
    path: ClassVar[str]  # the endpoint under /v1 (also the backend's path)
    operation: ClassVar[str]  # OpenTelemetry's gen_ai.operation.name
    # The output cap's request fields; with several, the smallest given holds.
    cap_fields: ClassVar[tuple[str, ...]] = ("max_tokens",)
    # Its SSE stream ends with ``data: [DONE]`` (OpenAI's chat and
    # completions); the typed-event APIs end with their own last event.
    done_marker: ClassVar[bool] = False
    # Delivered text can be read back from its events and continued by
    # another worker (workers.continuation).
    continuable: ClassVar[bool] = False
    # Errors and rate-limit headers in Anthropic's shape (docs/anthropic.md).
    anthropic: ClassVar[bool] = False
    # The body is OpenAI chat's: ``messages`` of role/content turns.
    openai_chat: ClassVar[bool] = False
    # Its stream is typed SSE events (``event:`` + ``data:``).
    typed_events: ClassVar[bool] = False
    # It answers with vectors: never streamed, no output tokens.
    vectors: ClassVar[bool] = False
    # It may run with no connection reading it (``background: true``).
    background: ClassVar[bool] = False
    # Served over the WebSocket protocol too (docs/websocket.md).
    on_websocket: ClassVar[bool] = False
    # Where its prompt is for an affinity key (tidegate.wire.affinity): chat
    # turns (``"messages"``), a completions prompt, or None (no key).
    affinity_field: ClassVar[str | None] = None
    # The request field naming an earlier response the backend stored, which
    # only the tenant that got it may name (workers.owners; None: none).
    previous_field: ClassVar[str | None] = None
    # The request field of its stop strings (None: it has none).
    stop_field: ClassVar[str | None] = None
    # Its stream reports usage only when asked (``stream_options``), and a
    # gateway adjusts its body; the others go as the client sent them.
    usage_asked: ClassVar[bool] = False
    # An OpenAI-compatible server may not serve it (501 endpoint_not_supported).
    optional_endpoint: ClassVar[bool] = True
    # Its events carry their own ``sequence_number`` (no SSE ``retry:`` needed).
    numbered_events: ClassVar[bool] = False
    # Its stream is OpenAI's ``choices`` chunks: what it delivered reads back
    # as text (tidegate.apis.delivered.joined_text).
    choice_chunks: ClassVar[bool] = False

    def validate(self, raw: bytes, models: Mapping[str, ModelConfig], *,
                 max_depth: int = DEFAULT_MAX_DEPTH,
                 max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES) -> Validated:
        """Parse and check a request body of this API (``tidegate.validation``:
        an OpenAI-style 400 naming the field); ``max_response_bytes`` bounds
        an answer whose size is known before it runs (embeddings)."""
        return self.validate_body(parse_json(raw, max_depth), models)

    def validate_body(self, body: dict[str, Any],
                      models: Mapping[str, ModelConfig]) -> Validated:
        """:meth:`validate` for a body already parsed (a WebSocket frame's,
        with the same strict, depth-bounded parser)."""
        raise NotImplementedError(f"{self.path} is validated from its raw body")

    def continue_body(self, body: dict[str, Any], text: str) -> None:
        """Rewrite ``body`` (a copy) so a backend goes on from ``text``, the
        answer so far (workers.continuation); nothing for an API that is
        not continued."""

    def chat_body(self, body: Mapping[str, Any]) -> Mapping[str, Any] | None:
        """The request as an OpenAI chat body (its turns as ``messages``), for
        what reads a conversation (the simulator's greedy text); None when it
        has no turns."""
        return None

    def prompt_cost(self, body: Mapping[str, Any]) -> float:
        """The prompt's estimated tokens, unrounded (tidegate.wire.tokens)."""
        raise NotImplementedError

    def prompt_tokens(self, body: Mapping[str, Any]) -> int:
        """The prompt's estimated tokens: a quota reservation's first part."""
        return math.ceil(self.prompt_cost(body))

    def output_cap(self, body: Mapping[str, Any]) -> int | None:
        """The request's own per-choice output cap (None: it sets none)."""
        given = [v for name in self.cap_fields if (v := as_int(body.get(name))) is not None]
        return max(0, min(given)) if given else None

    def choices(self, body: Mapping[str, Any]) -> int:
        """How many outputs the request generates."""
        return choice_count(body.get("n"))

    def completion_cap(self, body: Mapping[str, Any], default_max_tokens: int) -> int:
        """The most completion tokens the request can produce, over all its
        choices (``default_max_tokens`` per choice when it sets no cap)."""
        cap = self.output_cap(body)
        return (default_max_tokens if cap is None else cap) * self.choices(body)

    def reservation(self, body: Mapping[str, Any], default_max_tokens: int) -> int:
        """Tokens to reserve before the request runs: prompt estimate + completion cap."""
        return self.prompt_tokens(body) + self.completion_cap(body, default_max_tokens)
