"""The OpenAI Files API at the edge: upload, list, read, download, delete.

Files live in the ``<P>_FILES`` Object Store (``tidegate.control.batches``).
An upload is streamed from the multipart body into the store chunk by chunk
(``tidegate.broker.objects.put``) and a download from the store to the socket,
so a 200 MB file never sits in the edge's memory: it holds one chunk.

Every route authenticates and answers 404 for a file of another tenant, the
same answer as for a file that does not exist.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Mapping
from typing import TYPE_CHECKING, TypeVar

from aiohttp import BodyPartReader, web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError

from edge.auth import Principal, authorization
from edge.body import deadline
from tidegate.broker import objects
from tidegate.control.batches import Stores, open_stores
from tidegate.control.desk import Desk
from tidegate.errors import ApiError, BrokerError, invalid_request, no_such
from tidegate.wire.batch import FILE_PREFIX, FileRecord, new_file_id, valid_id

if TYPE_CHECKING:
    from edge.state import EdgeState

log = logging.getLogger("tidegate.edge")

PURPOSES = ("batch", "batch_output")  # what tidegate's files are for (uploads: "batch")
_READ = 64 << 10
_ENVELOPE = 64 << 10  # multipart boundaries and headers around the file itself
T = TypeVar("T")


class BatchApi:
    """What the file and batch routes share: the edge state and the stores,
    opened on first use (the edge starts without waiting for them)."""

    def __init__(self, state: EdgeState) -> None:
        self.state = state
        self._desk: Desk | None = None
        self._stores: Stores | None = None
        self._lock = asyncio.Lock()

    @property
    def desk(self) -> Desk:
        """Records and deletions go through a dispatcher (tidegate.control.desk):
        this edge's credentials only read the stores and publish chunks. Made
        on first use: building the app reads nothing but the config."""
        if self._desk is None:
            self._desk = Desk(self.state.nc, self.state.config.nats.subjects)
        return self._desk

    async def stores(self) -> Stores:
        if self._stores is None:
            async with self._lock:
                if self._stores is None:
                    self._stores = await open_stores(self.state.js, self.state.config)
        return self._stores

    def principal(self, request: web.Request) -> Principal:
        return self.state.keys.authenticate(authorization(request.headers))

    @staticmethod
    def auth(request: web.Request) -> str:
        """The key :meth:`principal` accepted, for the desk to check again."""
        return authorization(request.headers) or ""

    async def file(self, request: web.Request, file_id: str) -> FileRecord:
        """The caller's file, or 404."""
        principal = self.principal(request)
        if valid_id(file_id, FILE_PREFIX):
            file = await (await self.stores()).get_file(principal.tenant, file_id)
            if file is not None:
                return file
        raise no_such("File", file_id)


API: web.AppKey[BatchApi] = web.AppKey("tidegate_batch_api", BatchApi)


def register(app: web.Application, state: EdgeState) -> None:
    if API not in app:
        app[API] = BatchApi(state)
    app.router.add_post("/v1/files", upload)
    app.router.add_get("/v1/files", list_files)
    app.router.add_get("/v1/files/{file_id}", get_file)
    app.router.add_get("/v1/files/{file_id}/content", file_content)
    app.router.add_delete("/v1/files/{file_id}", delete_file)


async def upload(request: web.Request) -> web.Response:
    """Stream a multipart upload into the store. Invariant: when this does not
    answer 200, nothing of the upload is left in the store (every failure path,
    a client gone mid-body included, ends in :func:`_discard`)."""
    api = request.app[API]
    principal = api.principal(request)
    cfg = api.state.config.batch
    limit = cfg.max_file_bytes
    # The multipart envelope adds a few hundred bytes to the file itself.
    if request.content_length is not None and request.content_length > limit + _ENVELOPE:
        raise _too_large(limit)
    if not request.content_type.startswith("multipart/"):
        raise invalid_request("Upload a file as multipart/form-data with the fields 'file' "
                              "and 'purpose'.", param="file")
    stores = await api.stores()
    room = await _room(stores, principal.tenant, cfg.tenant_storage_bytes)
    if room is not None and (room <= 0 or (request.content_length or 0) > room + _ENVELOPE):
        raise _over_quota(cfg.tenant_storage_bytes)
    file_id = new_file_id()
    auth = api.auth(request)
    try:
        async with deadline(request, api.state.config.edge):
            purpose, filename, chunks = await _receive(request, stores, file_id, limit, room)
        if chunks is None:
            raise invalid_request("The upload has no 'file' field.", param="file",
                                  code="missing_required_parameter")
        if purpose != "batch":
            raise invalid_request(f"purpose must be 'batch' (tidegate's files are batch "
                                  f"inputs), got {purpose!r}.", param="purpose")
        file = await api.desk.record_file(auth, file_id, filename, purpose, chunks)
        # Concurrent uploads each saw room for themselves: counted again with
        # this file recorded, the tenant must still be within its quota.
        after = await _room(stores, principal.tenant, cfg.tenant_storage_bytes)
        if after is not None and after < 0:
            raise _over_quota(cfg.tenant_storage_bytes)
    except BaseException:
        await discard(api, auth, file_id)
        raise
    log.info("file %s uploaded by tenant %s: %d bytes", file_id, principal.tenant, file.size)
    return web.json_response(file.to_openai())


async def _receive(request: web.Request, stores: Stores, file_id: str, limit: int,
                   room: int | None) -> tuple[str, str, objects.Chunks | None]:
    """The upload's purpose, filename and chunks (None: no file part), its
    file part published as chunks ``file_id``. 413 past ``limit`` or the
    tenant's ``room``."""
    api = request.app[API]
    reader = await request.multipart()
    cap = limit if room is None else min(limit, room)
    purpose, filename, chunks = "", "", None
    try:
        while (part := await reader.next()) is not None:
            if not isinstance(part, BodyPartReader):
                continue
            if part.name == "purpose":
                purpose = (await part.text()).strip()
            elif part.name == "file" and chunks is None:
                filename = part.filename or "upload.jsonl"
                chunks = await objects.put_chunks(api.state.js, stores.files_bucket, file_id,
                                                  _chunks(part), limit=cap)
            else:
                await part.release()
    except objects.TooLarge:
        if cap < limit:
            raise _over_quota(api.state.config.batch.tenant_storage_bytes) from None
        raise _too_large(limit) from None
    except HttpProcessingError:
        # A part header aiohttp's parser refused (a control character, no
        # colon): its text quotes the header's bytes, which no answer echoes.
        raise invalid_request("A part header of the multipart body is malformed (it is not "
                              "repeated here).", param="file", code="invalid_body") from None
    except (ValueError, RequestPayloadError) as exc:
        # aiohttp's multipart reader: a body that ends before the closing
        # boundary ("Reading after EOF"), a bad part header, broken chunking.
        raise invalid_request(f"The multipart body is malformed or incomplete: {exc}.",
                              param="file", code="invalid_body") from None
    return purpose, filename, chunks


async def _room(stores: Stores, tenant: str, quota: int) -> int | None:
    """Bytes ``tenant`` may still store (negative: over), None without a quota.
    Every file of the tenant counts, batch outputs included: they take the
    same bucket space; deleting files frees it."""
    if not quota:
        return None
    return quota - sum(f.size for f in await stores.list_files(tenant))


async def discard(api: BatchApi, auth: str, file_id: str) -> None:
    """Have a dispatcher remove whatever an unfinished upload left (chunks,
    and the file if it was recorded); idempotent. Shielded: it runs while the
    handler is being cancelled (client gone) or timed out, and must not be
    cut short."""
    try:
        await asyncio.shield(api.desk.discard(auth, file_id))
    except Exception as exc:  # the upload's own error matters more; the TTL ages it out
        log.warning("could not remove the unfinished upload %s: %s", file_id, exc)


async def _chunks(part: BodyPartReader) -> AsyncIterator[bytes]:
    while chunk := await part.read_chunk(_READ):
        yield chunk


def _too_large(limit: int) -> ApiError:
    return ApiError(413, f"The file exceeds the limit of {limit} bytes.",
                    type="invalid_request_error", code="file_too_large", param="file")


def _over_quota(quota: int) -> ApiError:
    return ApiError(413, f"This upload would take your organization's stored files past its "
                         f"quota of {quota} bytes; delete files you no longer need "
                         f"(DELETE /v1/files/{{file_id}}) and retry.",
                    type="invalid_request_error", code="storage_quota_exceeded", param="file")


async def list_files(request: web.Request) -> web.Response:
    api = request.app[API]
    principal = api.principal(request)
    files = await (await api.stores()).list_files(principal.tenant)
    purpose = request.query.get("purpose")
    if purpose:
        files = [f for f in files if f.purpose == purpose]
    files.sort(key=lambda f: (f.created_at, f.id), reverse=request.query.get("order") != "asc")
    data, has_more = page(files, request.query, lambda f: f.id)
    return web.json_response({"object": "list", "data": [f.to_openai() for f in data],
                              "has_more": has_more,
                              "first_id": data[0].id if data else None,
                              "last_id": data[-1].id if data else None})


def page(items: list[T], query: Mapping[str, str], key: Callable[[T], str],
         default: int = 10_000) -> tuple[list[T], bool]:
    """OpenAI's cursor pagination: at most ``limit`` items (default
    ``default``), starting after the id ``after`` (the previous page's last)."""
    q = query
    try:
        limit = int(q.get("limit", default))
    except ValueError:
        raise invalid_request("limit must be an integer.", param="limit") from None
    if limit < 1:
        raise invalid_request("limit must be at least 1.", param="limit")
    after = q.get("after")
    if after:
        ids = [key(item) for item in items]
        items = items[ids.index(after) + 1:] if after in ids else []
    return items[:limit], len(items) > limit


async def get_file(request: web.Request) -> web.Response:
    api = request.app[API]
    file = await api.file(request, request.match_info["file_id"])
    return web.json_response(file.to_openai())


async def file_content(request: web.Request) -> web.StreamResponse:
    api = request.app[API]
    file = await api.file(request, request.match_info["file_id"])
    stores = await api.stores()
    chunks = objects.read(api.state.js, stores.files_bucket, file.id)
    # The first chunk before the status line: a file deleted (or lost) by
    # then gets an error response. Past the status line, a failure closes the
    # connection (edge.app's errors middleware), never a second response.
    try:
        first = await anext(chunks, b"")
    except BrokerError:
        await api.file(request, file.id)  # deleted since it was looked up: 404
        raise
    response = web.StreamResponse(headers={
        "Content-Type": "application/octet-stream",
        "Content-Disposition": f'attachment; filename="{_safe(file.filename)}"'})
    response.content_length = file.size
    await response.prepare(request)
    if first:
        await response.write(first)
    async for chunk in chunks:
        await response.write(chunk)  # drains: a slow client paces the object reads
    await response.write_eof()
    return response


def _safe(filename: str) -> str:
    """A filename fit for a quoted header value (the client chose it)."""
    return "".join(c if c.isascii() and c.isprintable() and c not in '"\\' else "_"
                   for c in filename)


async def delete_file(request: web.Request) -> web.Response:
    api = request.app[API]
    file = await api.file(request, request.match_info["file_id"])
    await api.desk.delete_file(api.auth(request), file.id)
    return web.json_response({"id": file.id, "object": "file", "deleted": True})
