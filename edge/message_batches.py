"""Anthropic's Message Batches API at the edge (docs/batch.md#anthropic-message-batches).

A create writes the requests as the runner's JSONL input file and records a
batch of endpoint ``/v1/messages``: from there the batch runner in the
dispatcher runs it as any OpenAI batch (spare capacity, quotas, per-key
rules, exactly once). Results are the runner's output and error files,
turned line by line into Anthropic's result lines as they stream out
(``tidegate.wire.message_batch``). Like every batch route, another tenant's
batch answers 404, the same as one that does not exist.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from aiohttp import web

from edge.anthropic import credentials
from edge.auth import Principal
from edge.body import read_within
from edge.files import API, BatchApi, discard
from edge.publish import models_for
from tidegate.apis.messages import DIALECT as MESSAGES
from tidegate.broker import objects
from tidegate.control.batches import Stores
from tidegate.errors import ApiError, BrokerError, ProtocolError, invalid_request
from tidegate.validation.jsonbody import parse_object
from tidegate.wire import classes
from tidegate.wire import message_batch as mb
from tidegate.wire.batch import (
    BatchRecord,
    BatchStatus,
    Counts,
    LineSplitter,
    new_batch_id,
    new_file_id,
)
from tidegate.wire.protocol import Request

if TYPE_CHECKING:
    from edge.state import EdgeState

log = logging.getLogger("tidegate.edge")

_WINDOW = 86400.0  # Anthropic: a batch ends (expires) 24 hours after creation
_MAX_LIMIT = 1000  # list: ``limit`` 1..1000, default 20


def register(app: web.Application, state: EdgeState) -> None:
    if API not in app:
        app[API] = BatchApi(state)
    app.router.add_post("/v1/messages/batches", create)
    app.router.add_get("/v1/messages/batches", list_batches)
    app.router.add_get("/v1/messages/batches/{batch_id}", retrieve)
    app.router.add_post("/v1/messages/batches/{batch_id}/cancel", cancel_batch)
    app.router.add_get("/v1/messages/batches/{batch_id}/results", results)


def _principal(api: BatchApi, request: web.Request) -> Principal:
    # x-api-key or a bearer token, as on POST /v1/messages
    return api.state.keys.authenticate(credentials(request.headers))


def _not_found(message_batch_id: str) -> ApiError:
    return ApiError(404, f"No such Message Batch: {message_batch_id[:80]}",
                    type="not_found_error", code="not_found", param="message_batch_id")


async def _batch(api: BatchApi, request: web.Request) -> BatchRecord:
    principal = _principal(api, request)
    public = request.match_info["batch_id"]
    record_id = mb.batch_id(public)
    if record_id is not None:
        batch = await (await api.stores()).get_batch(principal.tenant, record_id)
        if batch is not None and batch.endpoint == mb.ENDPOINT:
            return batch
    raise _not_found(public)


def _view(api: BatchApi, request: web.Request, batch: BatchRecord) -> dict[str, Any]:
    path = f"/v1/messages/batches/{mb.public_id(batch.id)}/results"
    try:  # absolute, as Anthropic's; the SDK fetches it as it is
        url = str(request.url.with_path(path).with_query(None))
    except ValueError:  # a Host header yarl refuses
        url = path
    return mb.batch_object(batch, time.time(), api.state.config.batch.file_ttl, url)


def _checker(api: BatchApi, principal: Principal) -> Any:
    """One request's params checked as ``POST /v1/messages`` checks a body,
    and as the runner checks the line (a number past 64 bits is 400)."""
    models = models_for(api.state, principal)

    def check(params: dict[str, Any]) -> None:
        valid = MESSAGES.validate_body(params, models)
        try:
            Request(id="-", reply="-", model=valid.model.name, api=valid.api, stream=False,
                    body=valid.body, created_ms=0, deadline_ms=0, window_bytes=0,
                    window_msgs=0, klass=classes.BATCH).encode()
        except ProtocolError:
            raise invalid_request("The request contains a number outside the 64-bit "
                                  "integer range.", code="invalid_value") from None
    return check


async def create(request: web.Request) -> web.Response:
    api = request.app[API]
    principal = _principal(api, request)
    config = api.state.config
    await read_within(request, config.edge)  # body deadline; past edge.max_body_bytes: 413
    raw = await request.read()
    body = parse_object(raw, config.edge.max_json_depth)
    check = _checker(api, principal)
    try:
        lines = mb.input_lines(raw, body, config.batch.max_lines, config.batch.max_line_bytes,
                               check)
    except ApiError:
        raise
    except Exception as exc:  # one tenant's odd request is its 400, never a 500
        log.warning("message batch create refused: %s: %s", type(exc).__name__, exc)
        raise invalid_request("A request of the batch could not be processed.") from None
    size = sum(len(line) for line in lines)
    stores = await api.stores()
    quota = config.batch.tenant_storage_bytes
    if quota and size > await _room(stores, principal.tenant, quota):
        raise _over_quota(quota)
    now = int(time.time())
    record_id, file_id = new_batch_id(), new_file_id()
    window = min(_WINDOW, config.batch.max_window)
    auth = credentials(request.headers) or ""
    try:
        chunks = await objects.put_chunks(api.state.js, stores.files_bucket, file_id,
                                          _aiter(lines))
        await api.desk.record_file(auth, file_id, f"{mb.public_id(record_id)}_requests.jsonl",
                                   "batch", chunks)
        if quota and await _room(stores, principal.tenant, quota) < 0:
            raise _over_quota(quota)  # concurrent creates each saw room for themselves
        batch = BatchRecord(
            id=record_id, tenant=principal.tenant, key_id=principal.key_id,
            user=principal.user, endpoint=mb.ENDPOINT, input_file_id=file_id,
            completion_window=f"{int(window)}s", created_at=now,
            expires_at=now + int(window), output_file_id=new_file_id(),
            error_file_id=new_file_id(), counts=Counts(total=len(lines)))
        batch = await api.desk.create_batch(auth, batch)
    except BaseException:
        await discard(api, auth, file_id)
        raise
    log.info("message batch %s created by tenant %s: %d requests", batch.id,
             principal.tenant, len(lines))
    return web.json_response(_view(api, request, batch))


async def _aiter(lines: list[bytes]) -> AsyncIterator[bytes]:
    for line in lines:
        yield line


async def _room(stores: Stores, tenant: str, quota: int) -> int:
    """Bytes ``tenant`` may still store: the same quota as uploads (edge.files)."""
    return quota - sum(f.size for f in await stores.list_files(tenant))


def _over_quota(quota: int) -> ApiError:
    return ApiError(413, f"This batch would take your organization's stored batch data past "
                         f"its quota of {quota} bytes; delete files you no longer need "
                         f"(DELETE /v1/files/{{file_id}}) and retry.",
                    type="invalid_request_error", code="storage_quota_exceeded")


async def retrieve(request: web.Request) -> web.Response:
    api = request.app[API]
    return web.json_response(_view(api, request, await _batch(api, request)))


async def list_batches(request: web.Request) -> web.Response:
    """Newest first; ``after_id`` pages to older batches, ``before_id`` to
    newer ones (the SDK's auto-pagination follows ``last_id`` / ``first_id``)."""
    api = request.app[API]
    principal = _principal(api, request)
    query = request.query
    try:
        limit = int(query.get("limit", "20"))
    except ValueError:
        limit = 0
    if not 1 <= limit <= _MAX_LIMIT:
        raise invalid_request(f"limit: must be an integer from 1 to {_MAX_LIMIT}.",
                              param="limit")
    after, before = query.get("after_id"), query.get("before_id")
    if after and before:
        raise invalid_request("Give after_id or before_id, not both.", param="before_id")
    batches = [b for b in await (await api.stores()).list_batches(principal.tenant)
               if b.endpoint == mb.ENDPOINT]
    ids = [mb.public_id(b.id) for b in batches]
    if after:
        start = ids.index(after) + 1 if after in ids else len(ids)
        data, has_more = batches[start:start + limit], len(batches) > start + limit
    elif before:
        end = ids.index(before) if before in ids else 0
        data, has_more = batches[max(0, end - limit):end], end - limit > 0
    else:
        data, has_more = batches[:limit], len(batches) > limit
    views = [_view(api, request, b) for b in data]
    return web.json_response({"data": views, "has_more": has_more,
                              "first_id": views[0]["id"] if views else None,
                              "last_id": views[-1]["id"] if views else None})


async def cancel_batch(request: web.Request) -> web.Response:
    api = request.app[API]
    batch = await _batch(api, request)
    try:
        updated = await api.desk.cancel_batch(credentials(request.headers) or "", batch.id,
                                              keep_finalizing=True)
    except ApiError as exc:
        if exc.code != "batch_not_cancellable":
            raise
        raise ApiError(409, f"Message Batch {mb.public_id(batch.id)} has ended; only a batch "
                            "in progress can be canceled.", type="invalid_request_error",
                       code="batch_not_cancellable") from None
    log.info("message batch %s: cancel requested", batch.id)
    return web.json_response(_view(api, request, updated))


async def results(request: web.Request) -> web.StreamResponse:
    """The result lines, streamed: the output file's, the error file's, then
    ``canceled`` for each request a cancel left unrun (found in the input).
    Held in memory: one chunk, one line, and the custom_ids seen only when
    some were canceled."""
    api = request.app[API]
    batch = await _batch(api, request)
    public = mb.public_id(batch.id)
    retention = api.state.config.batch.file_ttl
    if mb.archived(batch, time.time(), retention):
        raise ApiError(404, f"The results of Message Batch {public} have expired.",
                       type="not_found_error", code="results_expired")
    if not batch.terminal:
        raise invalid_request(f"Message Batch {public} has not ended; its results are "
                              "available once it has.", code="batch_not_ended")
    lines = _result_lines(api, await api.stores(), batch)
    try:  # the first line before the status line: a failure is still an error response
        first = await anext(lines, b"")
    except BrokerError:  # its files were deleted, or aged out before the record
        raise ApiError(404, f"The results of Message Batch {public} are no longer stored.",
                       type="not_found_error", code="results_expired") from None
    response = web.StreamResponse(headers={"Content-Type": "application/binary"})
    await response.prepare(request)
    if first:
        await response.write(first)
    async for line in lines:
        await response.write(line)  # drains: a slow client paces the object reads
    await response.write_eof()
    return response


async def _result_lines(api: BatchApi, stores: Stores,
                        batch: BatchRecord) -> AsyncIterator[bytes]:
    c = batch.counts
    if batch.status is BatchStatus.FAILED:
        # Refused at validation: each request errored, with its line's errors.
        errors = {e.line: e.message for e in batch.errors if e.line is not None}
        general = "; ".join(e.message for e in batch.errors if e.line is None)
        async for number, raw in _lines(api, stores, batch.input_file_id):
            yield mb.errored_line(_custom_id(raw), 400, errors.get(number) or general or
                                  "The batch failed validation.")
        return
    canceled = c.total - c.completed - c.failed
    seen: set[str] = set()
    for file_id, count in ((batch.output_file_id, c.completed), (batch.error_file_id, c.failed)):
        if not (count and batch.files_written):
            continue
        async for _, raw in _lines(api, stores, file_id):
            custom_id, line = mb.result_line(raw)
            if canceled > 0:
                seen.add(custom_id)
            yield line
    if canceled > 0:
        try:
            async for _, raw in _lines(api, stores, batch.input_file_id):
                custom_id = _custom_id(raw)
                if custom_id not in seen:
                    yield mb.canceled_line(custom_id)
        except BrokerError as exc:  # the input file was deleted through /v1/files
            log.warning("message batch %s: canceled requests not listed: %s", batch.id, exc)


def _custom_id(raw: bytes) -> str:
    return str(json.loads(raw).get("custom_id", ""))


async def _lines(api: BatchApi, stores: Stores, file_id: str) -> AsyncIterator[tuple[int, bytes]]:
    # Output lines are KV entries, each at most one NATS message.
    splitter = LineSplitter(max(api.state.config.batch.max_line_bytes, api.state.nc.max_payload))
    async for chunk in objects.read(api.state.js, stores.files_bucket, file_id):
        for item in splitter.feed(chunk):
            yield item
    for item in splitter.end():
        yield item
