"""One module per API dialect (docs/architecture.md, "API dialects"): what
each endpoint accepts, how it caps and prices its output, how its stream
ends, how it is continued. ``of(api)`` is a request's dialect; the tiers ask
it rather than comparing ``Api`` members (tests/test_dialects.py counts)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tidegate.apis import chat, completions, embeddings, messages, responses
from tidegate.apis.dialect import Dialect
from tidegate.config import ModelConfig
from tidegate.validation.generation import DEFAULT_MAX_DEPTH, Validated
from tidegate.validation.responses import DEFAULT_MAX_RESPONSE_BYTES
from tidegate.wire.protocol import Api

__all__ = ["ALL", "WEBSOCKET_PATHS", "Dialect", "by_path", "completion_cap",
           "estimate_prompt_tokens", "find", "of", "reservation", "validate_request"]

ALL: tuple[Dialect, ...] = (chat.DIALECT, completions.DIALECT, responses.DIALECT,
                            embeddings.DIALECT, messages.DIALECT)
_BY_API = {d.api: d for d in ALL}
_BY_PATH = {f"/v1{d.path}": d for d in ALL}
# The paths a WebSocket ``request`` frame may name (docs/websocket.md).
WEBSOCKET_PATHS: dict[str, Api] = {f"/v1{d.path}": d.api for d in ALL if d.on_websocket}


def of(api: Api | int) -> Dialect:
    """The dialect of ``api`` (a ``Request.api`` off the wire included)."""
    return _BY_API[Api(api)]


def find(api: int) -> Dialect | None:
    """The dialect of a wire value read back (a log's ``LogOpen.api``), or
    None for a value this version does not know."""
    try:
        return _BY_API[Api(api)]
    except ValueError:
        return None


def by_path(path: str) -> Dialect | None:
    """The dialect served at ``path`` (``/v1/chat/completions``...), if any."""
    return _BY_PATH.get(path)


def validate_request(raw: bytes, api: Api | int, models: Mapping[str, ModelConfig], *,
                     max_depth: int = DEFAULT_MAX_DEPTH,
                     max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES) -> Validated:
    """Parse and check a request body of any endpoint (:meth:`Dialect.validate`):
    the edge's, the gRPC ingress's and the batch lines' one entry point."""
    return _BY_API[Api(api)].validate(raw, models, max_depth=max_depth,
                                      max_response_bytes=max_response_bytes)


def estimate_prompt_tokens(api: Api | int, body: Mapping[str, Any]) -> int:
    """The prompt's estimated tokens (:meth:`Dialect.prompt_tokens`)."""
    return _BY_API[Api(api)].prompt_tokens(body)


def completion_cap(api: Api | int, body: Mapping[str, Any], default_max_tokens: int) -> int:
    """The most completion tokens the request can produce (:meth:`Dialect.completion_cap`)."""
    return _BY_API[Api(api)].completion_cap(body, default_max_tokens)


def reservation(api: Api | int, body: Mapping[str, Any], default_max_tokens: int) -> int:
    """Tokens to reserve before the request runs: prompt estimate + completion cap."""
    return _BY_API[Api(api)].reservation(body, default_max_tokens)
