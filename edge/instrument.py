"""The edge's telemetry for one HTTP request: its span, trace context, outcome.

``edge/app.py`` opens a :class:`RequestTelemetry` per generation request and
makes it current (a contextvar) for the request's task. The relay reports
what only it knows through the module functions, which find the current one
and do nothing when there is none (a relay under a unit test)::

    instrument.first_byte()        # the first output reached the client
    instrument.cancelled(reason)   # the edge cancelled upstream work
    instrument.failed(error)       # the request ends with this ApiError

Each is called at most a few times per request, never per chunk.
"""

from __future__ import annotations

import contextvars
import time
from collections.abc import Mapping

from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from tidegate import apis
from tidegate.errors import ApiError
from tidegate.telemetry import telemetry as tm
from tidegate.telemetry import tracing
from tidegate.telemetry.telemetry import Telemetry
from tidegate.wire.protocol import Api, Request

_current: contextvars.ContextVar[RequestTelemetry | None] = contextvars.ContextVar(
    "tidegate_edge_request", default=None)

# Causes that mean the client left, as opposed to the edge ending the request.
_CLIENT_GONE = frozenset({"client_disconnected", "slow_client",
                          "client_cancel"})  # an explicit cancel (WebSocket frame, POST)


class RequestTelemetry:
    __slots__ = ("api", "cancel_reason", "carrier", "code", "error_status", "first_byte_at",
                 "model", "span", "started", "tel", "trace_id")

    def __init__(self, tel: Telemetry, headers: Mapping[str, str], api: Api) -> None:
        self.tel = tel
        self.api = api
        self.started = time.monotonic()
        self.model = ""
        self.code = ""
        self.error_status = 0
        self.cancel_reason = ""
        self.first_byte_at = 0.0
        self.span: Span | None = None
        if tel.tracing:
            self.span = tel.tracer.start_span(
                apis.of(api).operation, context=tracing.extract(headers),
                kind=SpanKind.SERVER)
            self.carrier = tracing.inject(self.span)
        else:
            self.carrier = tracing.untraced_carrier(headers)
        self.trace_id = tracing.trace_id(self.carrier)

    def activate(self) -> contextvars.Token[RequestTelemetry | None]:
        return _current.set(self)

    def started_request(self, request: Request) -> None:
        self.model = request.model
        if self.span is not None:
            operation = apis.of(request.api).operation
            self.span.update_name(tracing.span_name(request, operation))
            self.span.set_attributes(tracing.request_attributes(request, operation))

    def on_first_byte(self) -> None:
        if self.first_byte_at:
            return
        self.first_byte_at = time.monotonic()
        self.tel.metrics.edge_time_to_first_byte.record(
            self.first_byte_at - self.started, {tm.MODEL: self.model})
        if self.span is not None:
            self.span.add_event(tracing.FIRST_TOKEN_EVENT)

    def on_cancel(self, reason: str) -> None:
        if self.cancel_reason:
            return
        self.cancel_reason = reason
        self.tel.metrics.cancellations.add(1, {tm.CAUSE: reason, tm.TIER: "edge"})
        if self.span is not None:
            self.span.add_event(tracing.CANCEL_EVENT, {tm.CAUSE: reason})

    def on_error(self, error: ApiError) -> None:
        if not self.code:
            self.code = error.code or error.type
            self.error_status = error.status

    def finish(self, status: int) -> None:
        """Count the request and end its span; ``status`` is the HTTP status
        sent (200 for a stream that ended with an error event)."""
        if self.cancel_reason in _CLIENT_GONE:
            outcome, code = "cancelled", self.cancel_reason
        elif self.code:
            error_status = self.error_status or status
            outcome = "client_error" if 400 <= error_status < 500 else "error"
            code = self.code
        elif status >= 400:
            outcome, code = ("client_error" if status < 500 else "error"), str(status)
        else:
            outcome, code = "ok", ""
        attrs: dict[str, str] = {tm.OUTCOME: outcome}
        if self.model:
            attrs[tm.MODEL] = self.model
        if code:
            attrs[tm.ERROR_TYPE] = code
        self.tel.metrics.edge_requests.add(1, attrs)
        span = self.span
        if span is not None:
            span.set_attribute("http.response.status_code", status)
            if outcome == "error":
                span.set_attribute(tm.ERROR_TYPE, code)
                span.set_status(Status(StatusCode.ERROR, code))
            elif code:
                span.set_attribute(tm.ERROR_TYPE, code)
            span.end()


def deactivate(token: contextvars.Token[RequestTelemetry | None]) -> None:
    _current.reset(token)


def current() -> RequestTelemetry | None:
    return _current.get()


def first_byte() -> None:
    rt = _current.get()
    if rt is not None:
        rt.on_first_byte()


def cancelled(reason: str) -> None:
    rt = _current.get()
    if rt is not None:
        rt.on_cancel(reason)


def failed(error: ApiError) -> None:
    rt = _current.get()
    if rt is not None:
        rt.on_error(error)
