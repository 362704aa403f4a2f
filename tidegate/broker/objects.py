"""Streaming reads and writes of JetStream Object Store objects.

The batch API's files live in ``<P>_FILES`` in the store's own format, so
``nats object ls/get`` read them; only the data path is ours, because nats-py's
cannot stream (its ``put`` wants a synchronous reader, its ``get`` collects
the object or queues chunks without bound).

Invariants: :func:`put` publishes each ``chunk_size`` slice with an acked
publish before reading more (the ack is the backpressure: one chunk in
memory); :func:`read` fetches one chunk per direct get, so a slow client paces
the reads. Both check the recorded SHA-256 digest.
"""

from __future__ import annotations

import base64
import hashlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime

import nats.js.errors
from nats.js import JetStreamContext, api
from nats.js.object_store import ObjectStore

from tidegate.broker import broker
from tidegate.errors import BrokerError, TidegateError

CHUNK = 128 << 10  # the Object Store's default chunk size


class NotFound(BrokerError):
    """:func:`read` of an object the store does not hold."""


class TooLarge(TidegateError):
    """The object grew past the limit given to :func:`put`; nothing is kept."""


def _meta_subject(bucket: str, name: str) -> str:
    return f"$O.{bucket}.M.{base64.urlsafe_b64encode(name.encode()).decode()}"


async def ensure_store(js: JetStreamContext, bucket: str, *, ttl: float, replicas: int,
                       file_storage: bool,
                       description: str = "tidegate: batch API files") -> ObjectStore:
    """The object store, created when missing; patient with a forming cluster
    (a JetStream timeout during an election took the dispatcher down)."""
    return await broker.patiently(
        lambda: _ensure_store(js, bucket, ttl=ttl, replicas=replicas,
                              file_storage=file_storage, description=description),
        f"object store {bucket}")


async def _ensure_store(js: JetStreamContext, bucket: str, *, ttl: float, replicas: int,
                        file_storage: bool, description: str) -> ObjectStore:
    try:
        return await js.object_store(bucket)
    except nats.js.errors.BucketNotFoundError:
        if not broker.provisions(js):
            raise broker.NotProvisioned(
                f"object store {bucket} does not exist, and this tier's NATS credentials may "
                f"not create it: run `tidegate setup` (admin credentials) first") from None
    storage = api.StorageType.FILE if file_storage else api.StorageType.MEMORY
    try:
        return await js.create_object_store(bucket, api.ObjectStoreConfig(
            description=description, ttl=ttl, storage=storage,
            replicas=replicas))
    except nats.js.errors.BadRequestError:
        return await js.object_store(bucket)  # created concurrently


@dataclass(frozen=True, slots=True)
class Chunks:
    """What :func:`put_chunks` wrote: the chunk subject's id and the object's
    size, chunk count and SHA-256 digest (the format's ``SHA-256=`` text)."""

    nuid: str
    size: int
    count: int
    digest: str


async def put(js: JetStreamContext, bucket: str, name: str, chunks: AsyncIterator[bytes],
              *, limit: int = 0, chunk_size: int = CHUNK) -> int:
    """Store ``chunks`` as object ``name``; returns its size. With ``limit``,
    raises :class:`TooLarge` (and purges what was written) once more arrives."""
    nuid = js._nc._nuid.next().decode()  # the format's chunk subject id
    try:
        written = await put_chunks(js, bucket, nuid, chunks, limit=limit, chunk_size=chunk_size)
        previous = await _info(js, bucket, name)
        await seal(js, bucket, name, written, chunk_size=chunk_size)
    except BaseException:
        try:
            await js.purge_stream(f"OBJ_{bucket}", subject=f"$O.{bucket}.C.{nuid}")
        except Exception:  # the original error matters more; the TTL ages chunks out
            pass
        raise
    if previous is not None and previous.nuid and previous.nuid != nuid:
        await js.purge_stream(f"OBJ_{bucket}", subject=f"$O.{bucket}.C.{previous.nuid}")
    return written.size


async def put_chunks(js: JetStreamContext, bucket: str, nuid: str,
                     chunks: AsyncIterator[bytes], *, limit: int = 0,
                     chunk_size: int = CHUNK) -> Chunks:
    """Publish ``chunks`` on the chunk subject ``nuid``, ``chunk_size`` at a
    time, and nothing else: no object exists until :func:`seal` names them
    (a tier that may only publish chunks, the edge, uploads this way). With
    ``limit``, raises :class:`TooLarge` once more arrives; what was written
    stays for the caller to purge."""
    chunk_subject = f"$O.{bucket}.C.{nuid}"
    digest = hashlib.sha256()
    pending = bytearray()
    size = count = 0
    async for data in chunks:
        size += len(data)
        if limit and size > limit:
            raise TooLarge(f"object exceeds {limit} bytes")
        pending += data
        while len(pending) >= chunk_size:
            piece = bytes(pending[:chunk_size])
            del pending[:chunk_size]
            digest.update(piece)
            await js.publish(chunk_subject, piece)
            count += 1
    if pending:
        piece = bytes(pending)
        digest.update(piece)
        await js.publish(chunk_subject, piece)
        count += 1
    return Chunks(nuid, size, count,
                  "SHA-256=" + base64.urlsafe_b64encode(digest.digest()).decode())


async def seal(js: JetStreamContext, bucket: str, name: str, written: Chunks, *,
               chunk_size: int = CHUNK) -> None:
    """Make the chunks ``written`` the object ``name`` (its meta entry, which
    replaces any earlier one of that name)."""
    info = api.ObjectInfo(
        name=name, bucket=bucket, nuid=written.nuid, size=written.size, chunks=written.count,
        mtime=datetime.now(UTC).isoformat(), digest=written.digest,
        options=api.ObjectMetaOptions(max_chunk_size=chunk_size))
    await js.publish(_meta_subject(bucket, name), json.dumps(info.as_dict()).encode(),
                     headers={"Nats-Rollup": "sub"})


async def exists(js: JetStreamContext, bucket: str, name: str) -> bool:
    """Whether the store holds an object ``name``."""
    return await _info(js, bucket, name) is not None


async def purge_chunks(js: JetStreamContext, bucket: str, nuid: str) -> None:
    """Remove the chunks published on ``nuid`` (an upload never sealed)."""
    await js.purge_stream(f"OBJ_{bucket}", subject=f"$O.{bucket}.C.{nuid}")


async def _info(js: JetStreamContext, bucket: str, name: str) -> api.ObjectInfo | None:
    try:
        msg = await js.get_last_msg(f"OBJ_{bucket}", _meta_subject(bucket, name))
    except nats.js.errors.NotFoundError:
        return None
    info = api.ObjectInfo.from_response(json.loads(msg.data or b"{}"))
    return None if info.deleted else info


async def read(js: JetStreamContext, bucket: str, name: str) -> AsyncIterator[bytes]:
    """The object's chunks in order, one fetched at a time. BrokerError if it
    is missing or its digest does not match (the last chunk is then withheld,
    so a consumer never sees a complete-looking corrupt object)."""
    info = await _info(js, bucket, name)
    if info is None:
        raise NotFound(f"object {name} not found in {bucket}")
    if not info.size:
        return
    stream, subject = f"OBJ_{bucket}", f"$O.{bucket}.C.{info.nuid}"
    digest = hashlib.sha256()
    seq, got, held = 1, 0, b""
    while got < (info.chunks or 0):
        msg = await js.get_msg(stream, seq=seq, subject=subject, next=True, direct=True)
        data = msg.data or b""
        digest.update(data)
        got += 1
        seq = (msg.seq or seq) + 1
        if held:
            yield held
        held = data
    expected = (info.digest or "").removeprefix("SHA-256=")
    if base64.urlsafe_b64encode(digest.digest()).decode() != expected:
        raise BrokerError(f"object {name} in {bucket} is corrupt (digest mismatch)")
    if held:
        yield held


async def delete(js: JetStreamContext, bucket: str, name: str) -> None:
    """Remove the object's chunks and its meta (idempotent)."""
    info = await _info(js, bucket, name)
    stream = f"OBJ_{bucket}"
    if info is not None and info.nuid:
        await js.purge_stream(stream, subject=f"$O.{bucket}.C.{info.nuid}")
    await js.purge_stream(stream, subject=_meta_subject(bucket, name))
