"""W3C trace context across the broker, and GenAI span attributes.

One trace per request: the edge starts it (continuing the client's
``traceparent``) and hands it on in the NATS headers of every publish and in
``Request.extra["traceparent"]`` (the worker's fallback parent, and what the
backend receives). With tracing off the edge still makes up an unsampled
``traceparent``, so every tier's log lines carry one trace id per request.

Spans follow the GenAI conventions: edge ``{operation} {model}`` (SERVER),
dispatcher ``dispatch {model}`` (CONSUMER), worker ``{operation} {model}``
(CLIENT); never a span per chunk. Docs: docs/observability.md.
"""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import Iterator, Mapping
from typing import Any

from opentelemetry.context import Context
from opentelemetry.trace import Span, SpanKind, get_current_span, set_span_in_context, use_span
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from tidegate.telemetry import telemetry as tm
from tidegate.telemetry.telemetry import Telemetry
from tidegate.wire.protocol import Request

TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"

FIRST_TOKEN_EVENT = "gen_ai.first_token"
CANCEL_EVENT = "tidegate.cancel"

REQUEST_ID = "tidegate.request.id"
TENANT = "tidegate.tenant"
CHUNKS = "tidegate.chunks"
ATTEMPT = "tidegate.attempt"
STALL_TIME = "tidegate.flow.stall_time"
QUEUE_WAIT = "tidegate.queue.wait"
REPLICA = "tidegate.replica"  # the backend replica a job was routed to ("" = shared queue)
ROUTE_REASON = "tidegate.route.reason"  # why (tidegate.wire.affinity.Reason)

_PROPAGATOR = TraceContextTextMapPropagator()
# --------------------------------------------------------------------------
# Propagation
# --------------------------------------------------------------------------


def extract(carrier: Mapping[str, Any] | None) -> Context | None:
    """The remote parent in ``carrier`` (NATS headers, HTTP headers,
    ``Request.extra``), or None when it has no valid ``traceparent``."""
    if not carrier:
        return None
    value = carrier.get(TRACEPARENT)
    if not isinstance(value, str) or not value:
        return None
    headers = {TRACEPARENT: value}
    state = carrier.get(TRACESTATE)
    if isinstance(state, str) and state:
        headers[TRACESTATE] = state
    context = _PROPAGATOR.extract(headers)
    span_context = get_current_span(context).get_span_context()
    return context if span_context.is_valid else None


def parent_of(headers: Mapping[str, str] | None, request: Request) -> Context | None:
    """A job's parent: the NATS headers (the previous hop's span), else the
    context the envelope carries (the edge's)."""
    return extract(headers) or extract(request.extra)


def inject(span: Span) -> dict[str, str]:
    """``traceparent`` (and ``tracestate``) naming ``span`` as the parent."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=set_span_in_context(span))
    return carrier


def untraced_carrier(headers: Mapping[str, str]) -> dict[str, str]:
    """Tracing off: the client's trace context as it came, or a fresh,
    unsampled one, so logs still correlate across tiers."""
    value = headers.get(TRACEPARENT)
    if value and len(value) == 55 and value[2] == "-":
        carrier = {TRACEPARENT: value}
        state = headers.get(TRACESTATE)
        if state:
            carrier[TRACESTATE] = state
        return carrier
    return {TRACEPARENT: f"00-{secrets.token_hex(16)}-{secrets.token_hex(8)}-00"}


def job_headers(headers: Mapping[str, str] | None) -> dict[str, str]:
    """Trace headers for a job publish: the current span's context when one
    records (the dispatcher's span), else the request's own trace headers
    passed on unchanged (tracing off, or a queued request granted later)."""
    span = get_current_span()
    if span.is_recording():
        return inject(span)
    if not headers:
        return {}
    return {k: headers[k] for k in (TRACEPARENT, TRACESTATE) if k in headers}


def set_route(replica: str | None, reason: str) -> None:
    """Name the replica a job was routed to, and why, on the current span."""
    span = get_current_span()
    if span.is_recording():
        span.set_attributes({REPLICA: replica or "", ROUTE_REASON: reason})


@contextlib.contextmanager
def dispatch_span(tel: Telemetry, headers: Mapping[str, str] | None,
                  request: Request, operation: str) -> Iterator[Span | None]:
    """The dispatcher's span for one request, current while the block runs
    (so :func:`job_headers` names it); ``None`` with tracing off.
    ``operation`` is its dialect's ``gen_ai.operation.name``."""
    if not tel.tracing:
        yield None
        return
    span = tel.tracer.start_span(f"dispatch {request.model}", kind=SpanKind.CONSUMER,
                                 context=parent_of(headers, request),
                                 attributes=request_attributes(request, operation))
    with use_span(span, end_on_exit=True):
        yield span


def trace_id(carrier: Mapping[str, Any] | None) -> str:
    """The 32-hex-digit trace id in a carrier's ``traceparent``, or ``""``."""
    value = carrier.get(TRACEPARENT) if carrier else None
    return value[3:35] if isinstance(value, str) and len(value) >= 35 else ""


def span_trace_id(span: Span) -> str:
    context = span.get_span_context()
    return f"{context.trace_id:032x}" if context.is_valid else ""


# --------------------------------------------------------------------------
# GenAI attributes
# --------------------------------------------------------------------------


def span_name(request: Request, operation: str) -> str:
    return f"{operation} {request.model}"


def request_attributes(request: Request, operation: str) -> dict[str, Any]:
    """Span attributes known when a request starts (no prompt content: it
    may be sensitive, and it is large); ``operation`` is its dialect's
    ``gen_ai.operation.name`` (``tidegate.apis``)."""
    attrs: dict[str, Any] = {
        tm.OPERATION: operation,
        tm.MODEL: request.model,
        REQUEST_ID: request.id,
        TENANT: request.tenant,
        tm.REQUEST_CLASS: request.klass,
        "gen_ai.request.stream": request.stream,
    }
    body = request.body
    for key, attr in (("max_tokens", "gen_ai.request.max_tokens"),
                      ("max_completion_tokens", "gen_ai.request.max_tokens"),
                      ("temperature", "gen_ai.request.temperature"),
                      ("top_p", "gen_ai.request.top_p"),
                      ("seed", "gen_ai.request.seed")):
        value = body.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool):
            attrs[attr] = value
    return attrs


def usage_attributes(prompt_tokens: int, completion_tokens: int, finish_reason: str,
                     chunks: int) -> dict[str, Any]:
    attrs: dict[str, Any] = {
        "gen_ai.usage.input_tokens": prompt_tokens,
        "gen_ai.usage.output_tokens": completion_tokens,
        CHUNKS: chunks,
    }
    if finish_reason:
        attrs["gen_ai.response.finish_reasons"] = (finish_reason,)
    return attrs
