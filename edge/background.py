"""The Responses API's background mode, served by tidegate from the stream log.

Any backend, any edge, for ``resume.retention``: ``POST /v1/responses`` with
``background: true`` runs as a resumable request no connection has to read
(answered at once, status ``queued``, once admitted; with ``stream: true`` the
creator gets the live events). ``GET /v1/responses/{id}`` is its state now;
``?stream=true&starting_after=N`` replays the events after N, then the live
tail; ``POST .../cancel`` cancels it, idempotently.

Ids are ``resp_`` + the request id; the worker renames the backend's own id to
it inside the events. Another tenant's, an unknown or an expired id answers 404
``response_not_found``. Docs: docs/resume.md.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import time
from typing import TYPE_CHECKING, Any

import nats.errors
import nats.js.errors
from aiohttp import web

from edge import idempotency, resume
from edge.errors import from_info, sse_error_event
from edge.logreader import valid_id
from edge.publish import build_request, publish_request
from edge.state import session_tick
from tidegate import apis
from tidegate.errors import ApiError, invalid_request, unavailable
from tidegate.wire import streamlog
from tidegate.wire.protocol import Admission, Error, ErrorInfo, Head, Status
from tidegate.wire.streamlog import LogCursor, LogEnd, LogEvent, LogOpen

if TYPE_CHECKING:
    from edge.auth import Principal
    from edge.instrument import RequestTelemetry
    from edge.state import EdgeState
    from tidegate.validation.generation import Validated

PREFIX = "resp_"
# Request.extra flag: no connection reads this request (workers.resumable).
BACKGROUND = "background"
_SEQ_RE = re.compile(rb'"sequence_number"\s*:\s*(\d+)')
_TYPE_RE = re.compile(rb'"type"\s*:\s*"(response\.(?:completed|incomplete|failed))"')
_SSE_HEADERS = {"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache",
                "X-Accel-Buffering": "no"}


def not_found() -> ApiError:
    return ApiError(404, "No response with this id (it may have expired, or was not a "
                         "background response).", type="invalid_request_error",
                    code="response_not_found", param="response_id")


def response_id(request_id: str) -> str:
    return PREFIX + request_id


def request_id_of(rid: str) -> str:
    """The request id in a response id; 404 for anything else (checked
    before any lookup, so a client's string never becomes a subject)."""
    if not rid.startswith(PREFIX) or not valid_id(rid[len(PREFIX):]):
        raise not_found()
    return rid[len(PREFIX):]


def grace(state: EdgeState) -> float:
    """A background response generates on without any reader, to its end."""
    return state.config.edge.request_timeout


def _base(rid: str, created_ms: int, model: str, status: str,
          body: dict[str, Any] | None = None) -> dict[str, Any]:
    body = body or {}
    return {"id": rid, "object": "response", "created_at": created_ms // 1000,
            "status": status, "background": True, "error": None, "incomplete_details": None,
            "instructions": body.get("instructions"), "model": model, "output": [],
            "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "tool_choice": body.get("tool_choice", "auto"), "tools": body.get("tools") or [],
            "metadata": body.get("metadata") or {}, "usage": None}


# -- create ------------------------------------------------------------------------------


async def create(http: web.Request, state: EdgeState, principal: Principal, valid: Validated,
                 rt: RequestTelemetry, request_id: str | None = None) -> web.Response:
    """``background: true`` without ``stream``: publish, wait for admission,
    answer the queued response object. Nobody relays; the log keeps it.
    ``request_id``: the one its Idempotency-Key names (``edge.idempotency``);
    one sent before answers the response object as it stands."""
    config = state.config
    request = build_request(state, principal, valid, rt.carrier, grace(state), request_id)
    request = dataclasses.replace(request, extra={**request.extra, BACKGROUND: True})
    rt.started_request(request)
    if request_id is not None:
        sent, young = await idempotency.sent_before(state, request.id, principal.tenant)
        if sent:
            if young:  # as edge.app: its edge may have died before publishing it
                await publish_request(state, request, rt.carrier)
            return await _replayed(state, request.id, principal.tenant)
    session = state.sessions.open(request.id, session_tick(config), principal.tenant)
    try:
        if (await publish_request(state, request, rt.carrier)).repeat:
            return await _replayed(state, request.id, principal.tenant)
        status = await _admission(session, config.edge.admission_timeout)
    finally:
        state.sessions.close(session)
    body = _base(response_id(request.id), request.created_ms, str(valid.body["model"]), status,
                 valid.body)
    return web.json_response(body, headers={"x-request-id": request.id,
                                            "x-tidegate-resumable": "true"})


async def _replayed(state: EdgeState, request_id: str, tenant: str) -> web.Response:
    return web.json_response(await snapshot(state, request_id, tenant), headers={
        "x-request-id": request_id, "x-tidegate-resumable": "true",
        idempotency.REPLAYED_HEADER: "true"})


async def _admission(session: Any, within: float) -> str:
    """``queued`` or ``in_progress`` once the dispatcher (or a worker) answered;
    a rejection or error is raised as the HTTP error it is."""
    try:
        async with asyncio.timeout(within):
            while True:
                await session.wait()
                if session.aborted is not None:
                    raise session.aborted
                for m in session.take():
                    if isinstance(m, Status):
                        if m.admission is Admission.REJECTED:
                            raise from_info(m.error) if m.error else unavailable("Rejected.")
                        return "queued"
                    if isinstance(m, Head):
                        return "in_progress"
                    if isinstance(m, Error):
                        raise from_info(m.error)
                session.take_tick()
    except TimeoutError:
        raise unavailable(f"No dispatcher answered within {within:g}s.",
                          code="dispatcher_unavailable", retry_after=5) from None


# -- retrieve -------------------------------------------------------------------------------


async def retrieve(http: web.Request, state: EdgeState, tenant: str) -> web.StreamResponse:
    rid = http.match_info["response_id"]
    request_id = request_id_of(rid)
    if http.query.get("stream", "").lower() in ("1", "true"):
        return await _stream(http, state, request_id, tenant, _starting_after(http))
    return web.json_response(await snapshot(state, request_id, tenant))


def _starting_after(http: web.Request) -> int:
    raw = http.query.get("starting_after", "-1")
    try:
        value = int(raw)
    except ValueError:
        value = -2
    if value < -1:
        raise invalid_request(f"'starting_after' must be a sequence number (>= 0), got {raw!r}.",
                              param="starting_after", code="invalid_value")
    return value


async def _read_log(state: EdgeState, request_id: str,
                    tenant: str) -> tuple[LogCursor, LogOpen, list[bytes], LogEnd | None]:
    """A snapshot of the log: every entry stored now, read with direct gets
    (no consumer, no attach): (cursor, its open entry, the events, the end).
    A log that went silent for longer than the edge's limits ends as a live
    reader's would: ``worker_lost`` once a worker ran it, else (or once it
    was handed back) ``no_worker_available``."""
    try:
        open_ = await state.streamlog.lookup(request_id, tenant)
    except ApiError as error:
        raise not_found() if error.status == 404 else error from None
    if not _background_api(open_.api):
        raise not_found()
    subjects = state.config.nats.subjects
    subject, stream = streamlog.subject(subjects, request_id), state.streamlog.stream
    cursor = LogCursor(0)
    cursor.open = open_
    events: list[bytes] = []
    end: LogEnd | None = None
    seq = 1
    last_at = open_.created_ms / 1000
    while end is None:
        try:
            raw = await state.js.get_msg(stream, seq=seq, subject=subject, next=True)
        except nats.js.errors.NotFoundError:
            break
        except (nats.errors.Error, TimeoutError) as exc:
            raise ApiError(503, f"The stream log is unavailable ({type(exc).__name__}).",
                           type="server_error", code="broker_unavailable", retryable=True,
                           retry_after=2) from None
        seq = int(raw.seq or seq) + 1
        if raw.time is not None:
            last_at = raw.time.timestamp()
        for entry in streamlog.decode_entry(raw.data or b""):
            for item in cursor.feed(entry):
                if isinstance(item, LogEvent):
                    events.append(item.data)
                else:
                    end = item
    if end is None:
        cfg = state.config
        silent = time.time() - last_at
        if cursor.control and not cursor.requeued:
            if silent > cfg.session.heartbeat_interval * cfg.session.worker_lost_after:
                end = LogEnd(error=streamlog.WORKER_LOST)
        elif silent > cfg.edge.queue_timeout + cfg.session.heartbeat_interval:
            end = LogEnd(error=ErrorInfo(503, "server_error", "no_worker_available",
                                         "No worker started this request in time.", True, 5.0))
    return cursor, open_, events, end


async def snapshot(state: EdgeState, request_id: str, tenant: str) -> dict[str, Any]:
    """The response object as it stands now."""
    cursor, open_, events, end = await _read_log(state, request_id, tenant)
    rid = response_id(request_id)
    model = _model(events)
    if end is not None and end.done is not None:
        final = _final(events, open_.stream)
        if final is not None:
            final["id"] = rid
            final["background"] = True
            return final
    status = "in_progress" if cursor.control else "queued"
    body = _base(rid, open_.created_ms, model, status)
    if end is not None and end.error is not None:
        cancelled = end.error.code in ("stream_cancelled", "client_cancel")
        body["status"] = "cancelled" if cancelled else "failed"
        if not cancelled:
            body["error"] = {"code": end.error.code, "message": end.error.message}
    elif end is not None:
        body["status"] = "completed"
    return body


def _model(events: list[bytes]) -> str:
    """The model named by the first event (response.created), if any."""
    match = re.search(rb'"model"\s*:\s*"([^"\\]*)"', events[0]) if events else None
    return match.group(1).decode("utf-8", "replace") if match else ""


def _final(events: list[bytes], stream: bool) -> dict[str, Any] | None:
    """The full response: a JSON body's, or a stream's terminal event's."""
    try:
        if not stream:
            obj = json.loads(b"".join(events))
            return obj if isinstance(obj, dict) else None
        for event in reversed(events):
            if _TYPE_RE.search(event):
                data = b"\n".join(line[5:].lstrip(b" ") for line in event.split(b"\n")
                                  if line.startswith(b"data:"))
                obj = json.loads(data)
                response = obj.get("response") if isinstance(obj, dict) else None
                return response if isinstance(response, dict) else None
    except ValueError:
        return None
    return None


async def _stream(http: web.Request, state: EdgeState, request_id: str, tenant: str,
                  after: int) -> web.StreamResponse:
    """Replay the events after sequence number ``after``, then the live tail."""
    try:
        await state.streamlog.lookup(request_id, tenant)
    except ApiError as error:
        raise not_found() if error.status == 404 else error from None
    async with state.streamlog.read(request_id, tenant, 0) as reader:
        if not _background_api(reader.open.api) or not reader.open.stream:
            raise not_found() if not _background_api(reader.open.api) else invalid_request(
                "This background response was not created with stream=true; retrieve it "
                "without stream.", param="stream", code="invalid_value")
        response = web.StreamResponse(status=200, headers={**_SSE_HEADERS,
                                                           "x-request-id": request_id})
        await response.prepare(http)
        config = state.config
        ping_every, slow = config.session.heartbeat_interval, config.edge.slow_client_timeout
        while True:
            try:
                item = await reader.next(ping_every)
            except StopAsyncIteration:
                break
            try:
                async with asyncio.timeout(slow):
                    if item is None:
                        await response.write(b": ping\n\n")
                    elif isinstance(item, LogEvent):
                        match = _SEQ_RE.search(item.data)
                        if match is None or int(match.group(1)) > after:
                            await response.write(item.data)
                    elif item.error is None:
                        await response.write_eof()
                        break
                    else:
                        await response.write(sse_error_event(from_info(item.error)))
                        await response.write_eof()
                        break
            except TimeoutError:
                if http.transport is not None:
                    http.transport.abort()
                break
        return response


# -- cancel ---------------------------------------------------------------------------------


async def cancel(http: web.Request, state: EdgeState, tenant: str) -> web.Response:
    """Cancel a background response (idempotent); answers its state."""
    request_id = request_id_of(http.match_info["response_id"])
    _, _, _, end = await _read_log(state, request_id, tenant)  # 404: others', unknown
    if end is None:
        try:
            await resume.cancel_stream(request_id, tenant, state.sessions, state.streamlog,
                                       state.relay.publisher.tombstone)
        except ApiError as error:
            if error.status != 404:
                raise
    body = await snapshot(state, request_id, tenant)
    if body["status"] in ("queued", "in_progress"):
        body["status"] = "cancelled"  # the log's end follows within milliseconds
    return web.json_response(body)


def _background_api(api: int) -> bool:
    """Whether a log's request came in on an API that runs in the background
    (the Responses API): only those are background responses to read."""
    dialect = apis.find(api)
    return dialect is not None and dialect.background
