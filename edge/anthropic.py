"""The edge's side of Anthropic's Messages API (docs/anthropic.md): how its
clients authenticate, what of their request goes on to the worker, and
``POST /v1/messages/count_tokens``. Errors take Anthropic's shape in
``edge.errors``; the events are written by workers, relayed as bytes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from aiohttp import web
from multidict import MultiMapping

from edge.auth import authorization, single
from tidegate.apis import estimate_prompt_tokens
from tidegate.errors import invalid_request
from tidegate.validation.generation import Validated
from tidegate.validation.messages import quota_user
from tidegate.wire.anthropic import forwarded_headers
from tidegate.wire.protocol import Request

__all__ = ["count_tokens_response", "credentials", "prepare"]


def credentials(headers: MultiMapping[str]) -> str | None:
    """The ``Authorization`` value to authenticate: Anthropic's clients send
    the key as ``x-api-key`` (the SDK, Claude Code with ANTHROPIC_API_KEY) or
    as a bearer token (ANTHROPIC_AUTH_TOKEN); ``Authorization`` wins when
    both are there. Either header twice is a 400 (``edge.auth.single``)."""
    bearer = authorization(headers)
    key = single(headers, "x-api-key")
    if bearer:
        return bearer
    return f"Bearer {key}" if key else None


def prepare(request: Request, headers: Mapping[str, str]) -> Request:
    """The envelope of a Messages request: ``anthropic-version`` and
    ``anthropic-beta`` ride along for a backend that serves the API itself
    (``extra["anthropic"]``), and ``metadata.user_id`` is the quota's user
    unless the key names one (a key's user is not the client's to change)."""
    forwarded = forwarded_headers(headers)
    for name, value in forwarded.items():
        # Sent on as they came, so only what passes unchanged: printable
        # ASCII (the values are version dates and beta names).
        if not (value.isascii() and value.isprintable()):
            raise invalid_request(f"The {name} header must be printable ASCII.", param=name,
                                  code="invalid_header")
    if forwarded:
        request.extra["anthropic"] = forwarded
    if not request.user:
        user = quota_user(request.body)
        if user:
            request = dataclasses.replace(request, user=user)
    return request


def count_tokens_response(valid: Validated) -> web.Response:
    """``{"input_tokens": N}``: tidegate's own estimate (tidegate.wire.tokens),
    labelled as one in ``x-tidegate-token-count: estimate``; no backend runs."""
    tokens = estimate_prompt_tokens(valid.api, valid.body)
    return web.json_response({"input_tokens": tokens},
                             headers={"x-tidegate-token-count": "estimate"})
