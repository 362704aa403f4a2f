"""The edge's HTTP surface (aiohttp): OpenAI-compatible routes and probes.

Handlers are thin: authenticate, validate, publish the request, hand the rest
to :class:`edge.relay.Relay`. Every error leaves through ``edge.errors``.

Each generation request gets a span (or, with tracing off, a made-up trace
context) from ``edge.instrument``; its ``traceparent`` goes into the
envelope's ``extra`` and the publish's NATS headers, and every log line of
the request carries its ids (``tidegate.telemetry.logs.bind``). ``GET /metrics`` is the
Prometheus exposition of this process.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
import socket
import time
import weakref
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import nats.errors
import nats.js.errors
from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js.api import PubAck

from edge import background, batches, files, instrument, resume
from edge.auth import KeyTable, Principal
from edge.errors import error_response, from_http_exception
from edge.logreader import StreamLog
from edge.relay import Publisher, Relay, RelayContext
from edge.session import SessionTable
from edge.validation import Validated
from edge.validation_responses import validate_request
from edge.ws_hub import WsHub
from tidegate.broker import broker
from tidegate.config import Config, EdgeConfig, ModelConfig
from tidegate.control.tenants import TenantTable
from tidegate.errors import ApiError, ProtocolError, invalid_request, unavailable
from tidegate.telemetry import logs, telemetry
from tidegate.telemetry.observability import metrics_handler
from tidegate.telemetry.telemetry import Telemetry
from tidegate.wire import streamlog
from tidegate.wire.protocol import Api, Request
from tidegate.wire.subjects import Subjects

log = logging.getLogger("tidegate.edge")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class NatsPublisher(Publisher):
    def __init__(self, nc: NATS, subjects: Subjects) -> None:
        self._nc = nc
        self._subjects = subjects

    async def publish(self, subject: str, payload: bytes) -> None:
        await self._nc.publish(subject, payload)

    async def tombstone(self, request_id: str, reason: str) -> None:
        # A KV put without waiting for JetStream's ack: the tombstone is the
        # safety net behind the direct Cancel, and a mass disconnect (10,000
        # clients of an edge at once) must not wait on 10,000 acked writes: the
        # bench saw them time out after nats.request_timeout, each holding its
        # handler that long.
        await self._nc.publish(self._subjects.cancel_key(request_id), reason.encode())


@dataclass(slots=True)
class EdgeState:
    """Everything the handlers share; one per edge process."""

    config: Config
    edge_id: str
    nc: NATS
    js: JetStreamContext
    keys: KeyTable
    sessions: SessionTable
    models: dict[str, ModelConfig] = field(init=False)
    relay: RelayContext = field(init=False)
    draining: bool = False
    telemetry: Telemetry = field(default_factory=telemetry.get)
    sockets: WsHub = field(default_factory=WsHub)  # open WebSockets (edge/ws.py)
    tenants: TenantTable = field(default_factory=TenantTable)  # followed from <P>_TENANTS
    # The reader of resumable streams' logs (edge.logreader): SSE resume here,
    # and every other reader (WebSocket, Responses, batch) uses it too.
    streamlog: StreamLog = field(init=False)

    def __post_init__(self) -> None:
        self.models = self.config.model_index()
        self.relay = RelayContext(self.config, NatsPublisher(self.nc, self.config.nats.subjects))
        self.streamlog = StreamLog(self.nc, self.js, self.config)


STATE: web.AppKey[EdgeState] = web.AppKey("tidegate_edge_state", EdgeState)


@web.middleware
async def errors_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as error:
        return error_response(error)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return error_response(from_http_exception(exc))
    except Exception:
        log.exception("unhandled error in %s %s", request.method, request.path)
        return error_response(ApiError(500, "Internal gateway error.", type="server_error",
                                       code="internal_error"))


def build_app(state: EdgeState) -> web.Application:
    app = web.Application(middlewares=[errors_middleware],
                          client_max_size=state.config.edge.max_body_bytes)
    app[STATE] = state
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/responses", responses)
    app.router.add_post("/v1/embeddings", embeddings)
    # Imported here: edge.ws builds on this module's request helpers.
    from edge.ws import websocket
    app.router.add_get("/v1/ws", websocket)
    app.router.add_get("/v1/models", list_models)
    files.register(app, state)
    batches.register(app, state)
    app.router.add_get("/v1/streams/{request_id}", get_stream)
    app.router.add_post("/v1/streams/{request_id}/cancel", cancel_stream)
    app.router.add_get("/v1/responses/{response_id}", get_response)
    app.router.add_post("/v1/responses/{response_id}/cancel", cancel_response)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
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
    state = request.app[STATE]
    state.keys.authenticate(request.headers.get("Authorization"))
    created = int(time.time())
    data = [{"id": name, "object": "model", "created": created, "owned_by": "tidegate"}
            for name in state.models]
    return web.json_response({"object": "list", "data": data})


async def get_stream(http: web.Request) -> web.StreamResponse:
    """Resume a stream (docs/resume.md)."""
    state = http.app[STATE]
    principal = state.keys.authenticate(http.headers.get("Authorization"))
    return await resume.stream_events(http, state.streamlog, state.config, principal.tenant)


async def cancel_stream(http: web.Request) -> web.StreamResponse:
    """Cancel a stream from any edge (docs/resume.md)."""
    state = http.app[STATE]
    principal = state.keys.authenticate(http.headers.get("Authorization"))
    return await resume.cancel_stream(http.match_info["request_id"], principal.tenant,
                                      state.sessions, state.streamlog,
                                      state.relay.publisher.tombstone)


async def get_response(http: web.Request) -> web.StreamResponse:
    """A background response's state, or its events (edge.background)."""
    state = http.app[STATE]
    principal = state.keys.authenticate(http.headers.get("Authorization"))
    return await background.retrieve(http, state, principal.tenant)


async def cancel_response(http: web.Request) -> web.StreamResponse:
    state = http.app[STATE]
    principal = state.keys.authenticate(http.headers.get("Authorization"))
    return await background.cancel(http, state, principal.tenant)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, Api.CHAT)


async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, Api.COMPLETIONS)


async def responses(request: web.Request) -> web.StreamResponse:
    return await _generate(request, Api.RESPONSES)


async def embeddings(request: web.Request) -> web.StreamResponse:
    return await _generate(request, Api.EMBEDDINGS)


async def _read_body(request: web.Request, limit: int, deadline: float) -> bytes:
    """The body, at most ``limit`` bytes, within ``deadline`` seconds (a body
    trickled byte by byte would hold a handler forever: 408). Read from the
    payload stream, not with ``request.read()``, which keeps a copy on the
    request object for the whole response: on a long stream that is a prompt
    per open connection."""
    if request.content_length is not None and request.content_length > limit:
        raise _too_large(limit)
    parts: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(deadline):
            async for part in request.content.iter_any():
                size += len(part)
                if size > limit:
                    raise _too_large(limit)
                parts.append(part)
    except TimeoutError:
        raise ApiError(408, f"The request body did not arrive within {deadline:g} seconds.",
                       type="invalid_request_error", code="request_timeout") from None
    except RequestPayloadError as exc:  # broken chunked encoding, bad Content-Encoding
        raise invalid_request(f"The request body is malformed: {exc}.",
                              code="invalid_body") from None
    return parts[0] if len(parts) == 1 else b"".join(parts)


def _too_large(limit: int) -> ApiError:
    return ApiError(413, f"The request body exceeds the limit of {limit} bytes.",
                    type="invalid_request_error", code="request_too_large")


# Client transports whose keepalive is set: a keep-alive connection carries
# many requests, and the options need setting once (four syscalls saved each).
_keepalive_set: weakref.WeakSet[asyncio.BaseTransport] = weakref.WeakSet()


def set_keepalive(transport: asyncio.BaseTransport | None, config: EdgeConfig) -> None:
    """TCP keepalive on the client socket, so a peer that vanished without a
    FIN (NAT timeout, pulled cable) is noticed even on an idle stream, and
    middleboxes see traffic. Linux option names; elsewhere SO_KEEPALIVE only."""
    if transport is None or not config.keepalive_idle or transport in _keepalive_set:
        return
    try:
        _keepalive_set.add(transport)
    except TypeError:  # a transport without weakrefs: configure it every request
        pass
    sock = transport.get_extra_info("socket")
    if sock is None:
        return
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        if hasattr(socket, "TCP_KEEPIDLE"):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, config.keepalive_idle)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, config.keepalive_interval)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, config.keepalive_count)
    except OSError as exc:  # e.g. a Unix socket
        log.debug("cannot set keepalive: %s", exc)


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


async def _handle_generate(http: web.Request, api: Api, state: EdgeState,
                           rt: instrument.RequestTelemetry) -> web.StreamResponse:
    config = state.config
    set_keepalive(http.transport, config.edge)
    principal = state.keys.authenticate(http.headers.get("Authorization"))
    if state.draining:
        raise unavailable("This edge is shutting down; retry on another.", code="edge_draining")
    raw = await _read_body(http, config.edge.max_body_bytes, config.edge.body_timeout)
    valid = validate_request(raw, api, state.models, max_depth=config.edge.max_json_depth)
    grace = resume.resume_grace(http.headers, state.tenants, principal.tenant, valid.model,
                                config)
    if valid.api is Api.RESPONSES and valid.body.get("background") is True:
        # Served from the stream log (edge.background): resumable, and it
        # generates to its end whether or not anyone reads.
        if not valid.stream:
            return await background.create(http, state, principal, valid, rt)
        grace = background.grace(state)
    request = build_request(state, principal, valid, rt.carrier, grace)
    request_id = request.id
    subjects = config.nats.subjects
    rt.started_request(request)
    del raw, valid  # the prompt lives on in `request` until it is published, no longer
    # Invariant: subscribed before publishing. The edge's inbox wildcard is
    # subscribed for the life of the process; opening the session makes the
    # dispatch table route this request's subject before anyone can answer.
    session = state.sessions.open(request_id, session_tick(config), principal.tenant)
    log_token = logs.bind(request_id, principal.tenant, rt.trace_id)
    try:
        seq = await publish_request(state, request, rt.carrier)
        headers = {"x-request-id": request_id, "x-tidegate-request-seq": str(seq)}
        if request.resumable:
            headers["x-tidegate-resumable"] = "true"
        log.debug("request %s published as %s seq %d", request_id, subjects.requests_stream, seq)
        # The relay needs the request's id, flags and window, not its prompt:
        # an edge holding 10,000 streams must not hold 10,000 prompts.
        request = dataclasses.replace(request, body={})
        return await Relay(http, session, request, state.relay, headers).run()
    finally:
        state.sessions.close(session)
        logs.unbind(log_token)


def session_tick(config: Config) -> float:
    """How often a session's clock checks (deadlines, pings, keepalive acks)
    run: a third of a heartbeat keeps pings on time, and a long tick keeps
    10,000 idle streams from costing the edge a core's worth of wakeups."""
    return min(max(config.session.heartbeat_interval / 3, 0.05), 5.0)


def build_request(state: EdgeState, principal: Principal, valid: Validated,
                  carrier: dict[str, str], grace: float | None = None) -> Request:
    """The envelope for one validated generation, with a fresh request id
    (96 random bits); 403 if the key may not use the model. Shared by the
    HTTP routes and the WebSocket adapter (``edge/ws.py``). ``grace``: a
    resumable stream's grace (``edge.resume.resume_grace``); None = not
    resumable."""
    if principal.models and not {valid.model.name, *valid.model.aliases} & set(principal.models):
        raise ApiError(403, f"This API key may not use model '{valid.body['model']}'. Allowed: "
                            f"{', '.join(principal.models)}.", type="permission_error",
                       code="model_not_allowed", param="model")
    config = state.config
    request_id = secrets.token_hex(12)
    subjects = config.nats.subjects
    now_ms = int(time.time() * 1000)
    return Request(
        id=request_id,
        reply=subjects.out(state.edge_id, request_id),
        model=valid.model.name,
        api=valid.api,
        stream=valid.stream,
        body=valid.body,
        created_ms=now_ms,
        deadline_ms=now_ms + int(config.edge.queue_timeout * 1000),
        window_bytes=config.session.window_bytes,
        window_msgs=config.session.window_msgs,
        include_usage=valid.include_usage,
        tenant=principal.tenant,
        user=principal.user,
        key_id=principal.key_id,
        edge=state.edge_id,
        mux=subjects.edge_mux(state.edge_id),
        extra=dict(carrier),
        resumable=grace is not None,
        grace=grace or 0.0,
    )


async def publish_request(state: EdgeState, request: Request,
                          trace_headers: dict[str, str]) -> int:
    """Publish to the requests stream; returns its JetStream sequence number.
    A resumable request's stream log is opened first."""
    if request.resumable:
        await _open_log(state, request)
    subject = state.config.nats.subjects.request(request.klass, request.tenant)
    try:
        payload = request.encode()
    except ProtocolError:
        raise invalid_request("The request contains a number outside the 64-bit integer "
                              "range.", code="invalid_value") from None
    if len(payload) > state.nc.max_payload:
        raise ApiError(413, "The request is too large for the broker's message size limit.",
                       type="invalid_request_error", code="request_too_large")
    try:
        ack = await publish_patiently(state, subject, payload,
                                      {"Nats-Msg-Id": request.id, **trace_headers})
    except nats.js.errors.APIError as exc:
        description = (exc.description or "").lower()
        if "maximum" in description or exc.code == 503:
            raise unavailable("The gateway's request queue is full; retry later.",
                              code="overloaded", retry_after=2) from None
        raise unavailable(f"The broker refused the request: {exc.description}",
                          code="broker_error") from None
    except (nats.errors.Error, TimeoutError) as exc:
        raise unavailable(f"The broker is unavailable ({type(exc).__name__}); retry later.",
                          code="broker_unavailable", retry_after=2) from None
    return int(ack.seq)


def _transient(exc: Exception) -> bool:
    """A publish that may succeed if tried again soon: no PubAck (the node
    died, the connection is reconnecting, the stream has no leader: "no
    responders"), or JetStream's 503 "temporarily unavailable" during an
    election. A full stream ("maximum ...") and other refusals are answers."""
    if isinstance(exc, nats.js.errors.APIError):
        return exc.code == 503 and "maximum" not in (exc.description or "").lower()
    return isinstance(exc, nats.errors.Error | TimeoutError)


async def publish_patiently(state: EdgeState, subject: str, payload: bytes,
                            headers: dict[str, str]) -> PubAck:
    """``js.publish``, retried for up to ``edge.publish_patience`` seconds
    (at most half of ``edge.admission_timeout``)
    while the broker is briefly unreachable (a NATS node's death, a leader
    election), instead of answering 503 at once. Safe because every caller
    sets ``Nats-Msg-Id``: a retry of a publish that did land (its PubAck
    lost) is dropped by the stream's duplicate window, so a request is
    never queued twice. The client waits meanwhile; the last error is
    raised when patience runs out or the connection is closed for good."""
    loop = asyncio.get_running_loop()
    edge = state.config.edge
    deadline = loop.time() + min(edge.publish_patience, edge.admission_timeout / 2)
    while True:
        try:
            return await state.js.publish(subject, payload, headers=headers)
        except Exception as exc:
            if (not _transient(exc) or state.nc.is_closed
                    or loop.time() + _PUBLISH_RETRY_DELAY >= deadline):
                raise
            log.info("publish to %s: %s; retrying", subject, type(exc).__name__)
        await asyncio.sleep(_PUBLISH_RETRY_DELAY)


_PUBLISH_RETRY_DELAY = 0.25


async def _open_log(state: EdgeState, request: Request) -> None:
    """The stream log's first entry (its tenant), stored before the request is
    published: a resume can then never find a stream without its owner."""
    entry = streamlog.LogOpen(request.tenant, request.stream, int(request.api),
                              request.created_ms, request.grace)
    try:
        # Its own message id: a retried open is stored once.
        await publish_patiently(state, streamlog.subject(state.config.nats.subjects, request.id),
                                entry.encode(), {"Nats-Msg-Id": f"{request.id}.open"})
    except (nats.errors.Error, TimeoutError) as exc:
        raise unavailable(f"The stream log is unavailable ({type(exc).__name__}); retry "
                          "later.", code="broker_unavailable", retry_after=2) from None
