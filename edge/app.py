"""The edge's HTTP surface (aiohttp): OpenAI-compatible routes and probes.

Handlers are thin: authenticate, validate, publish the request, hand the rest
to :class:`edge.relay.Relay`. Every error leaves through ``edge.errors``.

Each generation request gets a span (or, with tracing off, a made-up trace
context) from ``edge.instrument``; its ``traceparent`` goes into the
envelope's ``extra`` and the publish's NATS headers, and every log line of
the request carries its ids (``tidegate.telemetry.logs.bind``). ``GET /metrics`` (the
Prometheus exposition of this process, keyless) is on ``edge.metrics_port``
(``tidegate.telemetry.observability``), here only with ``edge.metrics_public``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable

from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError

from edge import anthropic, background, batches, files, idempotency, instrument, openapi, resume
from edge.auth import authorization
from edge.body import deadline as body_deadline
from edge.continuation import deciding_fields
from edge.errors import error_response, from_http_exception
from edge.message_batches import register as register_message_batches
from edge.publish import build_request, may_use, models_for, publish_request
from edge.relay import Relay
from edge.sse_writer import SseWriter
from edge.state import STATE, EdgeState, session_tick, set_keepalive
from edge.ws import websocket
from tidegate import apis
from tidegate.apis.chat import DIALECT as CHAT
from tidegate.apis.dialect import Dialect
from tidegate.apis.messages import DIALECT as MESSAGES
from tidegate.broker import broker
from tidegate.config import EdgeConfig
from tidegate.control.prices import COST_OPT_IN
from tidegate.errors import ApiError, invalid_request, unavailable
from tidegate.telemetry import logs
from tidegate.telemetry.observability import metrics_handler
from tidegate.validation.messages import validate_messages
from tidegate.wire.anthropic import is_messages_path
from tidegate.wire.protocol import Api

log = logging.getLogger("tidegate.edge")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def errors_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    # Anthropic's clients read errors in Anthropic's shape (edge.errors).
    api = MESSAGES.api if is_messages_path(request.path) else CHAT.api
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        _abort_if_started(request, exc)
        return error_response(from_http_exception(exc), api)
    except ApiError as error:
        _abort_if_started(request, error)
        return error_response(error, api)
    except Exception as exc:
        _abort_if_started(request, exc)
        log.exception("unhandled error in %s %s", request.method, request.path)
        return error_response(ApiError(500, "Internal gateway error.", type="server_error",
                                       code="internal_error"), api)


def _abort_if_started(request: web.Request, exc: Exception) -> None:
    """Invariant: one response per request. Once its status line is out, an
    error response would be read as body bytes (on a kept-alive connection,
    as the next response: a desync), so the connection is closed instead and
    the client sees a short body. Re-raises: aiohttp then writes nothing more
    (``edge.guard.GuardedHandler.handle_error``). One line, no traceback: a
    tenant deleting the file it downloads gets here."""
    if request.writer.output_size == 0:
        return
    log.warning("%s %s failed after its response started (%s: %s); connection closed",
                request.method, request.path, type(exc).__name__, str(exc)[:200])
    request.protocol.force_close()
    raise exc


def build_app(state: EdgeState) -> web.Application:
    app = web.Application(middlewares=[errors_middleware],
                          client_max_size=state.config.edge.max_body_bytes)
    app[STATE] = state
    for dialect in apis.ALL:  # /v1/chat/completions ... /v1/messages
        app.router.add_post(f"/v1{dialect.path}", _generation_route(dialect))
    app.router.add_post("/v1/messages/count_tokens", count_tokens)
    app.router.add_get("/v1/ws", websocket)
    app.router.add_get("/v1/models", list_models)
    files.register(app, state)
    batches.register(app, state)
    register_message_batches(app, state)
    app.router.add_get("/v1/streams/{request_id}", get_stream)
    app.router.add_post("/v1/streams/{request_id}/cancel", cancel_stream)
    app.router.add_get("/v1/responses/{response_id}", get_response)
    app.router.add_post("/v1/responses/{response_id}/cancel", cancel_response)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    openapi.prepare(app, state.config)  # GET /openapi.json, keyless
    if state.config.edge.metrics_public:  # opt-in: keyless, so off the API port by default
        app.router.add_get("/metrics", metrics_handler(state.telemetry))
    return app


async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    state = request.app[STATE]
    checks = {
        "nats_connected": state.nc.is_connected,
        "streams": state.nc.is_connected and await broker.streams_exist(state.js, state.config),
        "accepting": not state.draining,
    }
    ready = all(checks.values())
    return web.json_response({"ready": ready, "checks": checks}, status=200 if ready else 503)


async def list_models(request: web.Request) -> web.Response:
    """The models (names and aliases) the caller's key may use: a key
    restricted to some models does not learn the others."""
    state = request.app[STATE]
    principal = state.keys.authenticate(authorization(request.headers))
    created = int(time.time())
    data = [{"id": name, "object": "model", "created": created, "owned_by": "tidegate"}
            for name, model in state.models.items() if may_use(principal, model)]
    return web.json_response({"object": "list", "data": data})


async def get_stream(http: web.Request) -> web.StreamResponse:
    """Resume a stream (docs/resume.md)."""
    state = http.app[STATE]
    principal = state.keys.authenticate(authorization(http.headers))
    return await resume.stream_events(http, state.streamlog, state.config, principal.tenant)


async def cancel_stream(http: web.Request) -> web.StreamResponse:
    """Cancel a stream from any edge (docs/resume.md)."""
    state = http.app[STATE]
    principal = state.keys.authenticate(authorization(http.headers))
    return await resume.cancel_stream(http.match_info["request_id"], principal.tenant,
                                      state.sessions, state.streamlog,
                                      state.relay.publisher.tombstone)


async def get_response(http: web.Request) -> web.StreamResponse:
    """A background response's state, or its events (edge.background)."""
    state = http.app[STATE]
    principal = state.keys.authenticate(authorization(http.headers))
    return await background.retrieve(http, state, principal.tenant)


async def cancel_response(http: web.Request) -> web.StreamResponse:
    state = http.app[STATE]
    principal = state.keys.authenticate(authorization(http.headers))
    return await background.cancel(http, state, principal.tenant)


def _generation_route(dialect: Dialect) -> Handler:
    """The handler of ``dialect``'s endpoint (Anthropic's Messages too:
    edge.anthropic, docs/anthropic.md)."""
    async def generate(request: web.Request) -> web.StreamResponse:
        return await _generate(request, dialect.api)

    generate.__name__ = generate.__qualname__ = f"generate{dialect.path.replace('/', '_')}"
    return generate


async def count_tokens(http: web.Request) -> web.StreamResponse:
    state = http.app[STATE]
    principal = state.keys.authenticate(anthropic.credentials(http.headers))
    raw = await _read_body(http, state.config.edge.max_body_bytes, state.config.edge)
    valid = validate_messages(raw, MESSAGES.api, models_for(state, principal),
                              max_depth=state.config.edge.max_json_depth, count_tokens=True)
    return anthropic.count_tokens_response(valid)


async def _read_body(request: web.Request, limit: int, config: EdgeConfig) -> bytes:
    """The body, at most ``limit`` bytes, under the body deadline (a body
    trickled byte by byte would hold a handler forever: 408, edge/body.py).
    Read from the payload stream, not with ``request.read()``, which keeps a
    copy on the request object for the whole response: on a long stream that
    is a prompt per open connection."""
    if request.content_length is not None and request.content_length > limit:
        raise _too_large(limit)
    parts: list[bytes] = []
    size = 0
    try:
        async with body_deadline(request, config):
            async for part in request.content.iter_any():
                size += len(part)
                if size > limit:
                    raise _too_large(limit)
                parts.append(part)
    except RequestPayloadError as exc:  # broken chunked encoding, bad Content-Encoding
        raise invalid_request(f"The request body is malformed: {exc}.",
                              code="invalid_body") from None
    return parts[0] if len(parts) == 1 else b"".join(parts)


def _too_large(limit: int) -> ApiError:
    return ApiError(413, f"The request body exceeds the limit of {limit} bytes.",
                    type="invalid_request_error", code="request_too_large")


async def _generate(http: web.Request, api: Api) -> web.StreamResponse:
    state = http.app[STATE]
    rt = instrument.RequestTelemetry(state.telemetry, http.headers, api)
    token = rt.activate()
    status = 0
    try:
        response = await _handle_generate(http, api, state, rt)
        status = response.status
        return response
    except ApiError as error:
        rt.on_error(error)
        status = error.status
        raise
    except asyncio.CancelledError:
        rt.on_cancel("client_disconnected")
        raise
    except Exception:
        status = 500
        raise
    finally:
        rt.finish(status)
        instrument.deactivate(token)


async def _replayed(http: web.Request, state: EdgeState, request_id: str,
                    tenant: str) -> web.StreamResponse:
    """A request sent again under its Idempotency-Key: its stream, from the log."""
    return await resume.replay(http, state.streamlog, state.config, request_id, tenant,
                               extra={idempotency.REPLAYED_HEADER: "true"})


async def _handle_generate(http: web.Request, api: Api, state: EdgeState,
                           rt: instrument.RequestTelemetry) -> web.StreamResponse:
    config = state.config
    dialect = apis.of(api)
    set_keepalive(http.transport, config.edge)
    principal = state.keys.authenticate(anthropic.credentials(http.headers)
                                        if dialect.anthropic
                                        else authorization(http.headers))
    if state.draining:
        raise unavailable("This edge is shutting down; retry on another.", code="edge_draining")
    key = idempotency.key_of(http.headers)
    keyed_id = idempotency.request_id(principal.tenant, key, dialect.path) if key else None
    raw = await _read_body(http, config.edge.max_body_bytes, config.edge)
    valid = dialect.validate(raw, models_for(state, principal),
                             max_depth=config.edge.max_json_depth,
                             max_response_bytes=config.edge.max_response_bytes)
    grace = resume.resume_grace(http.headers, state.tenants, principal.tenant, valid.model,
                                config)
    if dialect.background and valid.body.get("background") is True:
        # Served from the stream log (edge.background): resumable, and it
        # generates to its end whether or not anyone reads.
        if not valid.stream:
            return await background.create(http, state, principal, valid, rt, keyed_id)
        grace = background.grace(state)
    request = build_request(state, principal, valid, rt.carrier, grace, keyed_id)
    if dialect.anthropic:
        request = anthropic.prepare(request, http.headers)
    if http.headers.get("x-tidegate-cost", "").strip().lower() == "include":
        # Opt-in: the final usage chunk carries the cost (docs/spend.md).
        request = dataclasses.replace(request, extra={**request.extra, COST_OPT_IN: True})
    request_id = request.id
    subjects = config.nats.subjects
    rt.started_request(request)
    del raw, valid  # the prompt lives on in `request` until it is published, no longer
    window = config.streams.duplicate_window
    if keyed_id is not None and request.resumable:
        sent, young = await idempotency.sent_before(state, request_id, principal.tenant)
        if sent:
            if young:  # its edge may have died between the log's open and the publish
                await publish_request(state, request, rt.carrier)
            return await _replayed(http, state, request_id, principal.tenant)
    # Invariant: subscribed before publishing. The edge's inbox wildcard is
    # subscribed for the life of the process; opening the session makes the
    # dispatch table route this request's subject before anyone can answer.
    session = state.sessions.open(request_id, session_tick(config), principal.tenant)
    log_token = logs.bind(request_id, principal.tenant, rt.trace_id)
    try:
        seq, repeat = await publish_request(state, request, rt.carrier)
        if repeat:
            # The stream held it already: its Idempotency-Key was sent before
            # (for a resumable request, at once on two connections: its log
            # was not there yet when this edge looked).
            if not request.resumable:
                raise idempotency.in_use(window)
            return await _replayed(http, state, request_id, principal.tenant)
        headers = {"x-request-id": request_id, "x-tidegate-request-seq": str(seq)}
        if dialect.anthropic:
            headers["request-id"] = request_id  # where Anthropic's SDK looks for it
        if request.resumable:
            headers["x-tidegate-resumable"] = "true"
        log.debug("request %s published as %s seq %d", request_id, subjects.requests_stream, seq)
        # The relay needs the request's id, flags and window, not its prompt:
        # an edge holding 10,000 streams must not hold 10,000 prompts; only
        # the few flags that decide whether it may be continued.
        request = dataclasses.replace(request, body=deciding_fields(request.body))
        out = SseWriter(http, request, headers, state.config)
        return await Relay(out, session, request, state.relay, headers).run()
    finally:
        state.sessions.close(session)
        logs.unbind(log_token)


