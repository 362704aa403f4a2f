"""What both gRPC methods share: metadata and auth, the error -> status
mapping, the flow-controlled message sink, and one generation from a
``GenerateRequest`` to its end (validated, published and relayed by the
same code as the SSE route: ``edge.publish``, :class:`edge.relay.Relay`,
writing through :class:`edge.grpc_writer.GrpcWriter`). Invariant: a
generation that published its request sends exactly one cancel upstream or
sees the end, however early its call is cancelled (:func:`run_generation`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
import weakref
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

import grpc
from multidict import CIMultiDict

from edge import instrument, resume
from edge.auth import Principal
from edge.continuation import deciding_fields
from edge.endings import SlowClient
from edge.grpc_writer import GrpcWriter, MessageSink
from edge.publish import build_request, models_for, publish_request
from edge.relay import Relay
from edge.state import EdgeState, session_tick
from tidegate import apis
from tidegate.errors import ApiError, invalid_request
from tidegate.telemetry import logs
from tidegate.validation.jsonbody import parse_object
from tidegate.wire import gateway_pb2 as pb
from tidegate.wire.protocol import Api

log = logging.getLogger("tidegate.edge")

CLIENT_DISCONNECTED = "client_disconnected"  # the reason Relay.run gives a client gone

# Each gRPC route is its HTTP endpoint's dialect (docs/grpc.md).
ROUTES: dict[int, Api] = {route: dialect.api for route, dialect in (
    (pb.ROUTE_CHAT_COMPLETIONS, apis.by_path("/v1/chat/completions")),
    (pb.ROUTE_COMPLETIONS, apis.by_path("/v1/completions")),
    (pb.ROUTE_RESPONSES, apis.by_path("/v1/responses")),
    (pb.ROUTE_EMBEDDINGS, apis.by_path("/v1/embeddings"))) if dialect is not None}

# HTTP status -> gRPC status (docs/grpc.md). A retryable error (broker down,
# worker lost, edge draining) is UNAVAILABLE whatever its HTTP status, except
# 429, which keeps RESOURCE_EXHAUSTED.
_CODES: dict[int, grpc.StatusCode] = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    403: grpc.StatusCode.PERMISSION_DENIED,
    404: grpc.StatusCode.NOT_FOUND,
    408: grpc.StatusCode.DEADLINE_EXCEEDED,
    409: grpc.StatusCode.ABORTED,
    413: grpc.StatusCode.INVALID_ARGUMENT,
    422: grpc.StatusCode.INVALID_ARGUMENT,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    499: grpc.StatusCode.CANCELLED,
    501: grpc.StatusCode.UNIMPLEMENTED,
    503: grpc.StatusCode.UNAVAILABLE,
    504: grpc.StatusCode.DEADLINE_EXCEEDED,
}


def status_of(error: ApiError) -> grpc.StatusCode:
    if error.status == 429:
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    if error.retryable:
        return grpc.StatusCode.UNAVAILABLE
    return _CODES.get(error.status, grpc.StatusCode.INTERNAL)


def error_details(error: ApiError) -> str:
    """The status details: the OpenAI error JSON, as the HTTP body would be."""
    return json.dumps(error.payload(), separators=(",", ":"))


def error_trailers(error: ApiError, headers: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    """Trailing metadata of a failed call: the request id and rate-limit
    headers, as HTTP sends them, and ``retry-after`` (seconds) when the
    client should wait before retrying (429, 503)."""
    out = [(k, v) for k, v in headers.items()
           if k == "x-request-id" or k.startswith("x-ratelimit-")]
    if error.retry_after:
        out.append(("retry-after", f"{error.retry_after:g}"))
    return tuple(out)


def error_message(gen_id: str, error: ApiError) -> pb.GenerateResponse:
    return pb.GenerateResponse(id=gen_id, error=pb.Error(
        code=status_of(error).value[0], http_status=error.status,
        error=error_details(error).encode()))


# Metadata the edge acts on: sent twice, it is refused (two ``authorization``
# values must not mean whichever one a layer happens to read). Any other key
# keeps its first value: proxies may repeat headers of their own.
_SINGLE = frozenset({"authorization", "traceparent", "tracestate"})


def metadata_of(context: grpc.aio.ServicerContext[Any, Any]) -> dict[str, str]:
    """The call's text metadata, keys lower case, first value of each."""
    out: dict[str, str] = {}
    for key, value in context.invocation_metadata() or ():
        if key.endswith("-bin") or not isinstance(value, str):
            continue
        key = key.lower()
        if key in out:
            if key in _SINGLE:
                raise invalid_request(f"Metadata '{key}' was sent more than once.",
                                      code="duplicate_metadata")
            continue
        out[key] = value
    return out


def authenticate(state: EdgeState, metadata: Mapping[str, str]) -> Principal:
    return state.keys.authenticate(metadata.get("authorization"))


M = TypeVar("M", pb.GenerateRequest, pb.SessionRequest)


def lenient(message: type[M]) -> Callable[[bytes], M | None]:
    """A request deserializer that returns None for bytes that are not a
    ``message``. grpcio answers a deserializer's exception itself, as
    UNKNOWN with the decoder's text and an ERROR line plus a traceback per
    call (any client, no key needed, could fill the log); None lets the
    handler check the key first and answer :func:`undecodable`."""
    def parse(data: bytes) -> M | None:
        try:
            parsed: M = message.FromString(data)
        except Exception:  # DecodeError, or whatever else the parser meets: not ours to log
            return None
        return parsed
    return parse


def undecodable(message: type[M]) -> ApiError:
    return invalid_request(f"The message is not a valid {message.DESCRIPTOR.full_name}.",
                           code="invalid_message")


class CallSink:
    """Writes one call's messages. ``context.write`` completes when HTTP/2
    flow control has room for the message: that wait is the backpressure.
    Several generations of a Session share the call, so writes take turns
    (a lock, uncontended on Generate). A write pending longer than
    edge.slow_client_timeout is ended by :class:`SlowWriters`.

    Invariant: at most one write is in grpc's core at a time, and none when
    the handler returns. Cancelling the task that awaits ``context.write``
    does not take the write back from the core; a second write, or the
    call's status, started beside it fails the whole call
    (``GRPC_CALL_ERROR_TOO_MANY_OPERATIONS``, found by the fuzzer: a Session
    ending while a generation's write was in flight). So a write runs in a
    future of its own: the next one waits for it, and :meth:`settle` before
    the handler returns."""

    __slots__ = ("__weakref__", "_context", "_lock", "_write", "slow", "task", "writing_since")

    def __init__(self, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        self._context = context
        self._lock = asyncio.Lock()
        self._write: asyncio.Future[None] | None = None
        self.writing_since = 0.0
        self.task: asyncio.Task[Any] | None = None
        self.slow = False

    async def settle(self) -> None:
        """Wait for a write whose sender was cancelled (the caller bounds it)."""
        write = self._write
        if write is not None and not write.done():
            await asyncio.wait({write})

    async def send(self, message: pb.GenerateResponse) -> None:
        if self.slow:
            raise SlowClient()
        async with self._lock:
            await self.settle()  # a cancelled sender's write, still in the core
            self.task = asyncio.current_task()
            self.writing_since = time.monotonic()
            write = self._write = asyncio.ensure_future(self._context.write(message))
            write.add_done_callback(_retrieved)
            try:
                await asyncio.shield(write)
            except asyncio.CancelledError:
                task = self.task
                if self.slow and task is not None and task.cancelling():
                    task.uncancel()
                    raise SlowClient() from None
                raise
            finally:
                self.writing_since = 0.0
                self.task = None


def _retrieved(write: asyncio.Future[None]) -> None:
    """A write's failure is its sender's to handle; one whose sender was
    cancelled has none, and asyncio would log it as never retrieved."""
    if not write.cancelled():
        write.exception()


class SlowWriters:
    """One task per edge that ends writes pending past the timeout: no timer
    per message on the chunk path."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.sinks: weakref.WeakSet[CallSink] = weakref.WeakSet()

    async def run(self) -> None:
        interval = min(max(self.timeout / 4, 0.05), 1.0)
        while True:
            await asyncio.sleep(interval)
            now = time.monotonic()
            for sink in list(self.sinks):
                since, task = sink.writing_since, sink.task
                if since and task is not None and now - since >= self.timeout and not sink.slow:
                    sink.slow = True
                    task.cancel()


@dataclasses.dataclass(slots=True)
class Generation:
    """What the caller needs while a generation runs: its relay (for cancel
    and drain), once published."""

    id: str
    relay: Relay | None = None
    cancel_requested: bool = False
    resumed: str = ""
    task: asyncio.Task[None] | None = None


def _body(req: pb.GenerateRequest, max_depth: int) -> bytes:
    """The body bytes, with the typed ``model`` checked against (or put into) it."""
    if not req.model:
        return req.body
    body = parse_object(req.body, max_depth)
    named = body.get("model")
    if named is not None and named != req.model:
        raise invalid_request("The request's model and the body's model differ.",
                              code="model_mismatch", param="model")
    body["model"] = req.model
    return json.dumps(body).encode()


async def _cancel_unrelayed(state: EdgeState, request_id: str) -> None:
    """The tombstone of a request that may be published and has no relay:
    the dispatcher or worker that has it, or gets it, drops it."""
    try:
        await state.relay.publisher.tombstone(request_id, CLIENT_DISCONNECTED)
    except Exception as exc:  # the broker being down must not mask the cancel
        log.warning("could not publish cancel for %s: %s", request_id, exc)


def api_of(req: pb.GenerateRequest) -> Api:
    api = ROUTES.get(req.route)
    if api is None:
        raise invalid_request("Unknown route: set route to one of ROUTE_CHAT_COMPLETIONS, "
                              "ROUTE_COMPLETIONS, ROUTE_RESPONSES, ROUTE_EMBEDDINGS.",
                              code="unknown_route", param="route")
    return api


async def run_generation(state: EdgeState, principal: Principal, req: pb.GenerateRequest,
                         metadata: Mapping[str, str], sink: MessageSink, gen: Generation,
                         rt: instrument.RequestTelemetry, deadline: float | None,
                         on_relay: Callable[[Relay], Awaitable[None]] | None = None,
                         ) -> tuple[ApiError | None, dict[str, str]]:
    """One generation from its request to its end. Raises ApiError for what
    fails before the relay runs; returns the relay's own failure (None:
    ``Done`` went out) and the response headers. ``deadline``: the
    client's, seconds from now (None: none)."""
    config = state.config
    api = api_of(req)
    if len(req.body) > config.edge.max_body_bytes:
        raise ApiError(413, f"The request body exceeds the limit of "
                            f"{config.edge.max_body_bytes} bytes.",
                       type="invalid_request_error", code="request_too_large")
    valid = apis.validate_request(_body(req, config.edge.max_json_depth), api,
                                  models_for(state, principal),
                                  max_depth=config.edge.max_json_depth,
                                  max_response_bytes=config.edge.max_response_bytes)
    if apis.of(valid.api).background and valid.body.get("background") is True:
        raise invalid_request("Background responses are not served over gRPC; use POST "
                              "/v1/responses.", code="unsupported_parameter",
                              param="background")
    headers: CIMultiDict[str] = CIMultiDict(metadata)
    if req.HasField("resumable"):
        headers[resume.RESUMABLE_HEADER] = "true" if req.resumable else "false"
    if req.HasField("resume_grace"):
        headers[resume.GRACE_HEADER] = repr(req.resume_grace)
    grace = resume.resume_grace(headers, state.tenants, principal.tenant, valid.model, config)
    request = build_request(state, principal, valid, rt.carrier, grace)
    if deadline is not None:
        # The client's deadline bounds the queue wait too: a request still
        # queued when its caller has given up is not started.
        request = dataclasses.replace(request, deadline_ms=min(
            request.deadline_ms, int((time.time() + deadline) * 1000)))
    rt.started_request(request)
    del valid
    session = state.sessions.open(request.id, session_tick(config), principal.tenant)
    log_token = logs.bind(request.id, request.tenant, rt.trace_id)
    # Invariant: every call that published a request sends exactly one cancel
    # or sees the end. Once relay.run() is entered, the relay does (Relay.run's
    # finally). Before, grpcio's cancel of this task (the client's cancel, the
    # deadline) may land while the publish is awaited, the request stored and
    # its PubAck unread: its tombstone goes out here, else a worker runs it for
    # nobody until session.ack_timeout (tests/test_grpc_cancel_storm.py).
    relayed = False
    try:
        seq = (await publish_request(state, request, rt.carrier)).seq
        relay_headers = {"x-request-id": request.id, "x-tidegate-request-seq": str(seq)}
        request = dataclasses.replace(request, body=deciding_fields(request.body))
        out = GrpcWriter(sink, gen.id, request)
        relay = Relay(out, session, request, state.relay, relay_headers)
        gen.relay = relay
        if on_relay is not None:
            await on_relay(relay)
        relayed = True
        await relay.run()
        return out.failure, relay.headers
    except asyncio.CancelledError:
        if not relayed:
            await _cancel_unrelayed(state, request.id)
        raise
    finally:
        state.sessions.close(session)
        logs.unbind(log_token)
