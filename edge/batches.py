"""The OpenAI Batches API at the edge: create, read, list, cancel.

The edge only records intent in the ``<P>_BATCHES`` KV bucket: a new batch
starts ``validating``, a cancel moves it to ``cancelling``. The batch runner
in the dispatcher (``dispatcher.batch.runner``) does everything else: it validates
the input file line by line, releases the lines into spare worker capacity,
collects the results and writes the output files.

Like the file routes, every route answers 404 for another tenant's batch.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from aiohttp import web

from edge.body import read_within
from edge.files import API, BatchApi, page
from tidegate.errors import invalid_request, no_such
from tidegate.validation.jsonbody import parse_object
from tidegate.wire.batch import (
    BATCH_PREFIX,
    ENDPOINTS,
    FILE_PREFIX,
    BatchRecord,
    new_batch_id,
    new_file_id,
    parse_window,
    valid_id,
)

if TYPE_CHECKING:
    from edge.state import EdgeState

log = logging.getLogger("tidegate.edge")

_MAX_METADATA = 16  # OpenAI: up to 16 key/value pairs, keys <= 64 and values <= 512 chars


def register(app: web.Application, state: EdgeState) -> None:
    if API not in app:
        app[API] = BatchApi(state)
    app.router.add_post("/v1/batches", create_batch)
    app.router.add_get("/v1/batches", list_batches)
    app.router.add_get("/v1/batches/{batch_id}", get_batch)
    app.router.add_post("/v1/batches/{batch_id}/cancel", cancel_batch)


async def _json_body(request: web.Request, max_depth: int) -> dict[str, Any]:
    """The body parsed as every route parses JSON (``tidegate.validation.jsonbody``):
    bounded nesting (50,000 ``[`` once made stdlib json raise RecursionError,
    a 500), strict JSON, no duplicate top-level key."""
    return parse_object(await request.read(), max_depth)


async def create_batch(request: web.Request) -> web.Response:
    api = request.app[API]
    principal = api.principal(request)
    await read_within(request, api.state.config.edge)  # body deadline; read() keeps the bytes
    cfg = api.state.config.batch
    body = await _json_body(request, api.state.config.edge.max_json_depth)
    endpoint = body.get("endpoint")
    if endpoint not in ENDPOINTS:
        raise invalid_request(f"endpoint must be one of {', '.join(ENDPOINTS)}, got "
                              f"{endpoint!r}.", param="endpoint")
    window = body.get("completion_window")
    try:
        seconds = parse_window(window) if isinstance(window, str) else -1.0
    except ValueError:
        seconds = -1.0
    if not 0 < seconds <= cfg.max_window:
        raise invalid_request(f"completion_window must be '24h' (or a shorter '<n>s|m|h' up "
                              f"to {cfg.max_window:g}s), got {window!r}.",
                              param="completion_window")
    metadata = _metadata(body.get("metadata"))
    file_id = body.get("input_file_id")
    if not isinstance(file_id, str) or not file_id:
        raise invalid_request("input_file_id is required.", param="input_file_id",
                              code="missing_required_parameter")
    file = await api.file(request, file_id) if valid_id(file_id, FILE_PREFIX) else None
    if file is None:
        raise no_such("File", file_id)
    if file.purpose != "batch":
        raise invalid_request(f"File {file_id} has purpose {file.purpose!r}, not 'batch'.",
                              param="input_file_id")
    if file.size > cfg.max_file_bytes:
        raise invalid_request(f"File {file_id} is {file.size} bytes, more than the batch "
                              f"limit of {cfg.max_file_bytes}.", param="input_file_id",
                              code="file_too_large")
    now = int(time.time())
    batch = BatchRecord(
        id=new_batch_id(), tenant=principal.tenant, key_id=principal.key_id,
        user=principal.user, endpoint=endpoint, input_file_id=file_id,
        completion_window=window if isinstance(window, str) else "24h", created_at=now,
        expires_at=now + int(seconds), output_file_id=new_file_id(),
        error_file_id=new_file_id(), metadata=metadata)
    batch = await api.desk.create_batch(api.auth(request), batch)
    return web.json_response(batch.to_openai())


def _metadata(raw: Any) -> dict[str, str] | None:
    if raw is None:
        return None
    if (not isinstance(raw, dict) or len(raw) > _MAX_METADATA
            or not all(isinstance(k, str) and isinstance(v, str) and len(k) <= 64
                       and len(v) <= 512 for k, v in raw.items())):
        raise invalid_request("metadata must be an object of at most 16 string pairs (keys up "
                              "to 64 characters, values up to 512).", param="metadata")
    return dict(raw)


async def _batch(api: BatchApi, request: web.Request) -> BatchRecord:
    principal = api.principal(request)
    batch_id = request.match_info["batch_id"]
    if valid_id(batch_id, BATCH_PREFIX):
        batch = await (await api.stores()).get_batch(principal.tenant, batch_id)
        if batch is not None:
            return batch
    raise no_such("Batch", batch_id)


async def get_batch(request: web.Request) -> web.Response:
    api = request.app[API]
    return web.json_response((await _batch(api, request)).to_openai())


async def list_batches(request: web.Request) -> web.Response:
    api = request.app[API]
    principal = api.principal(request)
    batches = await (await api.stores()).list_batches(principal.tenant)
    data, has_more = page(batches, request.query, lambda b: b.id, default=20)
    return web.json_response({"object": "list", "data": [b.to_openai() for b in data],
                              "has_more": has_more,
                              "first_id": data[0].id if data else None,
                              "last_id": data[-1].id if data else None})


async def cancel_batch(request: web.Request) -> web.Response:
    api = request.app[API]
    batch = await _batch(api, request)
    updated = await api.desk.cancel_batch(api.auth(request), batch.id)
    log.info("batch %s: cancel requested", batch.id)
    return web.json_response(updated.to_openai())
