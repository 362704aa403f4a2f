"""The OpenAPI 3.1 description of the edge's HTTP surface, served keyless at
``GET /openapi.json`` (docs/security.md, "Schema fuzzing").

``ROUTES`` is the one table of what each route takes; the request bodies'
schemas come from the validators' bounds (``tidegate.validation.schemas``), the
output token limit and the optional ``/metrics`` from the config. Invariant:
the table and the edge's route registrations are the same set of (method,
path) (``tests/test_openapi.py`` builds the app and compares), so a new route
fails the suite until it is described here.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from edge import idempotency
from tidegate import __version__
from tidegate.config import Config
from tidegate.validation.schemas import request_schemas

__all__ = ["DOCUMENT", "ROUTES", "Route", "document", "operations", "prepare", "serve"]

JSON = "application/json"
SSE = "text/event-stream"


@dataclass(frozen=True, slots=True)
class Route:
    """One operation: ``body`` names its request body's schema component;
    ``ok`` the media types of its success answer; ``query`` its query
    parameters as (name, JSON Schema)."""

    method: str
    path: str
    summary: str
    body: str | None = None
    body_media: str = JSON
    ok: tuple[str, ...] = (JSON,)
    status: int = 200
    query: tuple[tuple[str, dict[str, Any]], ...] = ()
    headers: tuple[tuple[str, dict[str, Any]], ...] = ()
    keyless: bool = False
    anthropic: bool = False  # the key may also come as x-api-key; errors in Anthropic's shape


_PAGE = (("limit", {"type": "integer", "minimum": 1}), ("after", {"type": "string"}))
# Printable ASCII, no space at either end (the edge strips them first).
_KEY_MIDDLE = idempotency.MAX_LENGTH - 2
_IDEMPOTENCY = (("Idempotency-Key", {"type": "string",
                                     "pattern": f"^[!-~]([ -~]{{0,{_KEY_MIDDLE}}}[!-~])?$"}),)

ROUTES: tuple[Route, ...] = (
    Route("POST", "/v1/chat/completions", "Chat completion (SSE with stream: true)",
          "ChatCompletionRequest", ok=(JSON, SSE), headers=_IDEMPOTENCY),
    Route("POST", "/v1/completions", "Text completion (legacy)", "CompletionRequest",
          ok=(JSON, SSE), headers=_IDEMPOTENCY),
    Route("POST", "/v1/responses", "Create a response (background: true runs it detached)",
          "ResponseRequest", ok=(JSON, SSE), headers=_IDEMPOTENCY),
    Route("GET", "/v1/responses/{response_id}", "A background response, or its events",
          ok=(JSON, SSE), query=(("stream", {"type": "boolean"}),
                                 ("starting_after", {"type": "integer", "minimum": -1}))),
    Route("POST", "/v1/responses/{response_id}/cancel", "Cancel a background response"),
    Route("POST", "/v1/embeddings", "Embeddings", "EmbeddingRequest"),
    Route("POST", "/v1/messages", "Anthropic Messages", "MessagesRequest", ok=(JSON, SSE),
          anthropic=True, headers=_IDEMPOTENCY),
    Route("POST", "/v1/messages/count_tokens", "Anthropic token count", "CountTokensRequest",
          anthropic=True),
    Route("GET", "/v1/models", "The models this key may use"),
    Route("GET", "/v1/ws", "WebSocket upgrade (docs/websocket.md); frames are JSON text",
          ok=(), status=101),
    Route("GET", "/v1/streams/{request_id}", "Resume a stream after Last-Event-ID",
          ok=(SSE,), query=(("after", {"type": "integer", "minimum": 0}),),
          headers=(("Last-Event-ID", {"type": "string", "pattern": "^[0-9]*$"}),)),
    Route("POST", "/v1/streams/{request_id}/cancel", "Cancel a stream from any edge"),
    Route("POST", "/v1/files", "Upload a batch input file", "FileUpload",
          body_media="multipart/form-data"),
    Route("GET", "/v1/files", "This tenant's files", query=(
        *_PAGE, ("order", {"enum": ["asc", "desc"]}), ("purpose", {"type": "string"}))),
    Route("GET", "/v1/files/{file_id}", "A file's record"),
    Route("GET", "/v1/files/{file_id}/content", "A file's bytes",
          ok=("application/octet-stream",)),
    Route("DELETE", "/v1/files/{file_id}", "Delete a file"),
    Route("POST", "/v1/batches", "Create a batch", "BatchRequest"),
    Route("GET", "/v1/batches", "This tenant's batches", query=_PAGE),
    Route("GET", "/v1/batches/{batch_id}", "A batch"),
    Route("POST", "/v1/batches/{batch_id}/cancel", "Cancel a batch"),
    Route("POST", "/v1/messages/batches", "Create an Anthropic Message Batch",
          "MessageBatchRequest", anthropic=True),
    Route("GET", "/v1/messages/batches", "This tenant's Message Batches", anthropic=True,
          query=(("limit", {"type": "integer", "minimum": 1, "maximum": 1000}),
                 ("after_id", {"type": "string"}), ("before_id", {"type": "string"}))),
    Route("GET", "/v1/messages/batches/{batch_id}", "A Message Batch", anthropic=True),
    Route("POST", "/v1/messages/batches/{batch_id}/cancel", "Cancel a Message Batch",
          anthropic=True),
    Route("GET", "/v1/messages/batches/{batch_id}/results", "A Message Batch's results",
          ok=("application/binary",), anthropic=True),
    Route("GET", "/healthz", "Liveness", keyless=True),
    Route("GET", "/readyz", "Readiness (503 while not ready)", keyless=True),
    Route("GET", "/openapi.json", "This description", keyless=True),
    Route("GET", "/metrics", "Prometheus exposition (only with edge.metrics_public)",
          ok=("text/plain",), keyless=True),
)

_ID_PATTERNS = {"file_id": "^file-[0-9a-f]{32}$", "batch_id": "^batch_[0-9a-f]{32}$",
                "msgbatch_id": "^msgbatch_[0-9a-f]{32}$"}


def operations(config: Config) -> Iterator[Route]:
    """The routes this config's edge registers."""
    for route in ROUTES:
        if route.path != "/metrics" or config.edge.metrics_public:
            yield route


def _id_pattern(path: str, name: str) -> dict[str, str]:
    if path.startswith("/v1/messages/batches/"):
        name = "msgbatch_id"
    return {"pattern": _ID_PATTERNS[name]} if name in _ID_PATTERNS else {}


def _parameters(route: Route) -> list[dict[str, Any]]:
    params: list[dict[str, Any]] = [
        {"name": name, "in": "path", "required": True,
         "schema": {"type": "string", "minLength": 1, **_id_pattern(route.path, name)}}
        for name in re.findall(r"\{(\w+)\}", route.path)]
    params += [{"name": name, "in": "query", "schema": schema} for name, schema in route.query]
    params += [{"name": name, "in": "header", "schema": schema} for name, schema in route.headers]
    return params


def _operation(route: Route) -> dict[str, Any]:
    error = {"$ref": "#/components/schemas/Error"}
    success: dict[str, Any] = {"description": route.summary}
    if route.ok:
        success["content"] = {media: {"schema": {} if media != JSON else {"type": "object"}}
                              for media in route.ok}
    op: dict[str, Any] = {
        "summary": route.summary,
        "operationId": f"{route.method.lower()} {route.path}",
        "responses": {str(route.status): success,
                      "default": {"description": "An error (Anthropic's shape on /v1/messages)",
                                  "content": {JSON: {"schema": error}}}},
    }
    if params := _parameters(route):
        op["parameters"] = params
    if route.body is not None:
        op["requestBody"] = {"required": True, "content": {route.body_media: {
            "schema": {"$ref": f"#/components/schemas/{route.body}"}}}}
    if route.keyless:
        op["security"] = []
    elif route.anthropic:
        op["security"] = [{"bearer": []}, {"x-api-key": []}]
    return op


def document(config: Config) -> dict[str, Any]:
    paths: dict[str, dict[str, Any]] = {}
    for route in operations(config):
        paths.setdefault(route.path, {})[route.method.lower()] = _operation(route)
    max_tokens = max((m.max_output_tokens for m in config.models), default=1)
    return {
        "openapi": "3.1.0",
        "info": {"title": "tidegate", "version": __version__,
                 "description": "An OpenAI- and Anthropic-compatible streaming gateway. "
                                "Unknown request fields pass through to the backend. "
                                "Integers are written without a fraction (1, not 1.0)."},
        "paths": paths,
        "components": {
            "schemas": request_schemas(max_tokens, config.batch.max_lines),
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"},
                                "x-api-key": {"type": "apiKey", "in": "header",
                                              "name": "x-api-key"}},
        },
        "security": [{"bearer": []}],
    }


DOCUMENT: web.AppKey[bytes] = web.AppKey("tidegate_openapi", bytes)


def prepare(app: web.Application, config: Config) -> None:
    """Build the description once, at startup, and register its route."""
    app[DOCUMENT] = json.dumps(document(config), separators=(",", ":")).encode()
    app.router.add_get("/openapi.json", serve)


async def serve(request: web.Request) -> web.Response:
    return web.Response(body=request.app[DOCUMENT], content_type=JSON)
