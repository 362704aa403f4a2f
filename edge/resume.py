"""Resumable streams at the edge: opt-in, ``/v1/streams`` routes, remote cancel.

* :func:`resume_grace` decides whether a request is resumable (header
  ``X-Tidegate-Resumable``, the tenant's setting, the model's config) and with
  which grace (``X-Tidegate-Resume-Grace``, the tenant's, ``resume.grace``).
* ``GET /v1/streams/{request_id}`` replays a stream from ``Last-Event-ID`` (or
  ``?after=N``) and follows its live tail, on any edge (``edge.logreader``).
* ``POST /v1/streams/{request_id}/cancel`` cancels a stream at once,
  resumable or not, from any edge: the edge holding the request's connection
  (found with a core NATS request to every edge) ends it, and a resumable
  stream's worker gets the cancel through its tombstone.

Every route checks the caller's tenant: another tenant's id is 404
``stream_not_found``, exactly as an unknown one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Mapping

import msgpack
from aiohttp import web
from nats.aio.msg import Msg

from edge.endings import reconnect_event
from edge.errors import sse_error_event
from edge.logreader import Draining, LogReader, StreamLog, not_found, valid_id
from edge.session import SessionTable
from tidegate import apis
from tidegate.apis.chat import DIALECT as CHAT
from tidegate.config import Config, ModelConfig
from tidegate.control.tenants import TenantTable
from tidegate.errors import ApiError, invalid_request
from tidegate.wire import streamlog
from tidegate.wire.protocol import Api, Error, ErrorInfo
from tidegate.wire.streamlog import LogEnd, LogEvent

log = logging.getLogger("tidegate.edge")

RESUMABLE_HEADER = "X-Tidegate-Resumable"
GRACE_HEADER = "X-Tidegate-Resume-Grace"
_DONE = b"data: [DONE]\n\n"
_PING = b": ping\n\n"
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")

CANCELLED = ApiError(409, "The stream was cancelled (POST /v1/streams/{id}/cancel).",
                     type="invalid_request_error", code="stream_cancelled")
_CANCELLED_INFO = ErrorInfo(409, "invalid_request_error", "stream_cancelled",
                            CANCELLED.message, False, 0.0)
# How long an edge waits for the edge holding a stream to answer a cancel.
_REMOTE_CANCEL_TIMEOUT = 0.5


def resume_grace(headers: object, tenants: TenantTable, tenant: str, model: ModelConfig,
                 config: Config) -> float | None:
    """The grace of a resumable request, or None when it is not resumable.

    The header wins in both directions (``false`` turns a tenant's or model's
    default off for one request); then the tenant's setting, then the model's.
    """
    get = headers.get  # type: ignore[attr-defined]
    raw = get(RESUMABLE_HEADER)
    settings = tenants.get(tenant)
    if raw is not None:
        value = raw.strip().lower()
        if value in _FALSE:
            return None
        if value not in _TRUE:
            # Header values are never echoed (docs/security.md).
            raise invalid_request(f"{RESUMABLE_HEADER} must be true or false.",
                                  code="invalid_header")
    elif not ((settings is not None and settings.resumable) or model.resumable):
        return None
    grace = config.resume.grace
    if settings is not None and settings.grace is not None:
        grace = settings.grace
    raw_grace = get(GRACE_HEADER)
    if raw_grace is not None:
        try:
            grace = float(raw_grace)
        except ValueError:
            grace = -1.0
        if not 0 <= grace <= config.resume.max_grace:
            raise invalid_request(f"{GRACE_HEADER} must be seconds between 0 and "
                                  f"{config.resume.max_grace:g}.", code="invalid_header")
    return min(grace, config.resume.max_grace)


def _after(http: web.Request) -> int:
    raw = http.headers.get("Last-Event-ID")
    if raw is None:
        raw = http.query.get("after", "0")
    # ASCII digits only (an empty value is 0, as in the SSE spec): int() also
    # takes "+5", "1_0" and non-ASCII digits, none of them an id this edge sent.
    text = raw.strip() or "0"
    after = int(text) if text.isascii() and text.isdigit() else -1
    if after < 0:
        raise invalid_request("Last-Event-ID / after must be a non-negative event id.",
                              code="invalid_value", param="after")
    return after


async def stream_events(http: web.Request, streamlog_: StreamLog, config: Config,
                        tenant: str) -> web.StreamResponse:
    """``GET /v1/streams/{request_id}``: the events after ``Last-Event-ID``,
    then the live tail, then ``data: [DONE]`` (or a final error event)."""
    return await replay(http, streamlog_, config, http.match_info["request_id"], tenant,
                        _after(http))


async def replay(http: web.Request, streamlog_: StreamLog, config: Config, request_id: str,
                 tenant: str, after: int = 0, extra: Mapping[str, str] | None = None,
                 ) -> web.StreamResponse:
    """A stream's events after ``after`` from its log, then its live tail
    (a non-streaming request's body, once complete); ``extra``: headers."""
    async with streamlog_.read(request_id, tenant, after) as reader:
        headers = {"x-request-id": request_id, "x-tidegate-resumable": "true", **(extra or {})}
        if not reader.open.stream:
            return await _body(reader, headers)
        response = web.StreamResponse(status=200, headers={
            "Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no", **headers})
        await response.prepare(http)
        await _follow(http, response, reader, config.session.heartbeat_interval,
                      config.edge.slow_client_timeout, config.resume.retry_ms,
                      Api(reader.open.api) if reader.open.api in set(Api) else CHAT.api)
        return response


async def _follow(http: web.Request, response: web.StreamResponse, reader: LogReader,
                  ping_every: float, slow: float, retry_ms: int, api: Api) -> None:
    """Write the reader's items until the end, or the reconnect event at drain.

    As the live stream did (edge.relay): a Responses or Messages stream ends
    with its own terminal event, never ``[DONE]``, its first event carries
    no ``retry:`` field (its events are numbered), and an error is its API's
    error event.

    The reconnect event names ``reader.last_id``: the reader hands out no
    item once the edge drains (``next_unless_draining``), and every item it
    handed out was written before the next read, so that id is the last
    event this client got, and resuming after it loses none."""
    own_end = not apis.of(api).done_marker
    retry = b"" if own_end else streamlog.retry_field(retry_ms)  # in the first event's block
    while True:
        try:
            item = await reader.next_unless_draining(ping_every)
        except StopAsyncIteration:
            return
        if isinstance(item, Draining):
            with contextlib.suppress(ConnectionError, RuntimeError):
                await response.write_eof(reconnect_event(reader.request_id, reader.last_id,
                                                         retry_ms))
            return
        try:
            async with asyncio.timeout(slow):
                if item is None:
                    await response.write(_PING)
                elif isinstance(item, LogEvent):
                    await response.write(b"%bid: %d\n%b" % (retry, item.id, item.data))
                    retry = b""
                elif item.error is None:
                    await response.write_eof(b"" if own_end else _DONE)
                    return
                else:
                    await response.write(sse_error_event(_api_error(item.error), api))
                    await response.write_eof()
                    return
        except TimeoutError:
            if http.transport is not None:
                http.transport.abort()
            return


async def _body(reader: LogReader, headers: dict[str, str]) -> web.Response:
    """A non-streaming resumable request: its JSON body, once complete."""
    parts: list[bytes] = []
    async for item in reader:
        if isinstance(item, LogEvent):
            parts.append(item.data)
        elif isinstance(item, LogEnd) and item.error is not None:
            raise _api_error(item.error)
    return web.Response(body=b"".join(parts), content_type="application/json", headers=headers)


def _api_error(info: ErrorInfo) -> ApiError:
    return ApiError(info.status, info.message, type=info.type, code=info.code or None,
                    retryable=info.retryable, retry_after=info.retry_after)


async def cancel_stream(request_id: str, tenant: str, sessions: SessionTable,
                        streamlog_: StreamLog,
                        tombstone: Callable[[str, str], Awaitable[None]]) -> web.Response:
    """``POST /v1/streams/{request_id}/cancel``. Idempotent: cancelling a
    stream that already ended (and is still in the log) answers 200 too."""
    if not valid_id(request_id):
        raise not_found()
    ok = {"id": request_id, "object": "stream.cancel", "cancelled": True}
    if local_cancel(sessions, request_id, tenant):
        return web.json_response(ok)
    nc = streamlog_.nc
    cfg = streamlog_.config
    payload = msgpack.packb([request_id, tenant])
    try:
        await streamlog_.lookup(request_id, tenant)
    except ApiError as error:
        if error.status != 404:
            raise
        # Not resumable (or unknown): only the edge holding it can tell.
        try:
            reply = await nc.request(streamlog.edge_cancel_subject(cfg.nats.subjects), payload,
                                     timeout=_REMOTE_CANCEL_TIMEOUT)
        except Exception:
            raise not_found() from None
        if reply.data != b"1":
            raise not_found() from None
        return web.json_response(ok)
    # Resumable: the tombstone reaches the worker (and a dispatcher or worker
    # that has not started it), whatever edge holds the connection, if any;
    # the edge holding it hears too; and the log gets a final event for a
    # stream that no worker runs (an entry the log's readers ignore once a
    # worker has: its own cancel Error follows).
    await tombstone(request_id, "client_cancel")
    await nc.publish(streamlog.edge_cancel_subject(cfg.nats.subjects), payload)
    await nc.publish(streamlog.subject(cfg.nats.subjects, request_id),
                     Error(0, _CANCELLED_INFO).encode())
    return web.json_response(ok)


def local_cancel(sessions: SessionTable, request_id: str, tenant: str) -> bool:
    """End the stream if this edge holds it for ``tenant``."""
    session = sessions.get(request_id)
    if session is None or session.tenant != tenant:
        return False
    session.abort(CANCELLED)
    return True


def remote_cancel_handler(sessions: SessionTable) -> Callable[[Msg], Awaitable[None]]:
    """The subscriber of ``<p>.streams.cancel``: another edge asks every edge
    to cancel a stream; the one holding it does and says so."""

    async def on_cancel(msg: Msg) -> None:
        try:
            request_id, tenant = msgpack.unpackb(msg.data)
        except Exception:
            return
        if local_cancel(sessions, str(request_id), str(tenant)) and msg.reply:
            await msg.respond(b"1")

    return on_cancel
