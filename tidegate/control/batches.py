"""Where the batch API keeps its state: KV buckets and the files' Object Store.

``<P>_FILES`` (Object Store): file contents. ``<P>_FILEMETA`` (KV): a
:class:`FileRecord` per file. ``<P>_BATCHES`` (KV): a :class:`BatchRecord` per
batch, plus the runner's lease under :data:`LEASE_KEY`. ``<P>_BATCHOUT`` (KV):
one entry per finished line, created first-writer-wins, which makes the output
one line per ``custom_id`` however often a line ran.

Invariants: every client lookup is scoped to its tenant (another tenant's id
reads as missing: 404, never 403); batch records change by compare-and-set
(:func:`update_batch`); an unreadable entry is skipped by listings and reads as
missing by id. Docs: docs/batch.md.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TypeVar

import nats.js.errors
from nats.js import JetStreamContext
from nats.js.kv import KeyValue
from nats.js.object_store import ObjectStore

from tidegate.broker import broker, kvwatch, objects
from tidegate.config import Config
from tidegate.errors import ProtocolError
from tidegate.wire.batch import BatchRecord, FileRecord

log = logging.getLogger("tidegate.batch")

LEASE_KEY = "runner-lease"
_UNREADABLE_MEMORY = 1024  # unreadable keys remembered as logged; past it, logged again
R = TypeVar("R", FileRecord, BatchRecord)


class Stores:
    """The batch API's buckets, opened (or created) once per process."""

    def __init__(self, config: Config, js: JetStreamContext, files: ObjectStore,
                 filemeta: KeyValue, batches: KeyValue, results: KeyValue) -> None:
        self.config = config
        self.js = js
        self.files = files
        self.filemeta = filemeta
        self.batches = batches
        self.results = results
        self._unreadable: set[str] = set()  # keys already logged (Stores._readable)

    @property
    def files_bucket(self) -> str:
        return bucket_names(self.config)[0]

    def _readable(self, key: str, data: bytes | None,
                  decode: Callable[[bytes], R]) -> R | None:
        """The record, or None when there is none or it is unreadable.
        Invariant: one bad entry (anyone with a tier's NATS credentials can
        write one) hides only itself, never a listing; it is logged once per
        key, not once per request that lists it."""
        if data is None:
            return None
        try:
            return decode(data)
        except ProtocolError as exc:
            if key not in self._unreadable:
                if len(self._unreadable) >= _UNREADABLE_MEMORY:
                    self._unreadable.clear()
                self._unreadable.add(key)
                log.warning("skipping the unreadable entry %r: %s", key[:64], exc)
            return None

    # -- files -------------------------------------------------------------------

    async def get_file(self, tenant: str, file_id: str) -> FileRecord | None:
        file = self._readable(file_id, await _get(self.filemeta, file_id), FileRecord.decode)
        return file if file is not None and file.tenant == tenant else None

    async def filemeta_entry(self, file_id: str) -> bytes | None:
        """The file's record as stored, whoever's it is (None: no record)."""
        return await _get(self.filemeta, file_id)

    async def put_file(self, file: FileRecord) -> None:
        await self.filemeta.put(file.id, file.encode())

    async def list_files(self, tenant: str) -> list[FileRecord]:
        out = []
        for key, data in (await _values(self.filemeta)).items():
            file = self._readable(key, data, FileRecord.decode)
            if file is not None and file.tenant == tenant:
                out.append(file)
        return out

    async def delete_file(self, file_id: str) -> None:
        await objects.delete(self.js, self.files_bucket, file_id)
        await self.filemeta.delete(file_id)

    # -- batches -----------------------------------------------------------------

    async def get_batch(self, tenant: str | None, batch_id: str) -> BatchRecord | None:
        """The batch, if it exists and (unless ``tenant`` is None, the
        operator's view) belongs to ``tenant``."""
        batch = self._readable(batch_id, await _get(self.batches, batch_id),
                               BatchRecord.decode)
        return batch if batch is not None and (tenant is None or batch.tenant == tenant) \
            else None

    async def create_batch(self, batch: BatchRecord) -> None:
        await self.batches.create(batch.id, batch.encode())

    async def list_batches(self, tenant: str | None) -> list[BatchRecord]:
        """Newest first."""
        out = []
        for key, data in (await _values(self.batches)).items():
            if key == LEASE_KEY:
                continue
            batch = self._readable(key, data, BatchRecord.decode)
            if batch is not None and (tenant is None or batch.tenant == tenant):
                out.append(batch)
        out.sort(key=lambda b: (b.created_at, b.id), reverse=True)
        return out

    async def update_batch(self, batch_id: str,
                           change: Callable[[BatchRecord], BatchRecord | None]) -> BatchRecord:
        """Apply ``change`` by compare-and-set until it sticks; ``change``
        returning None leaves the record as it is. Returns the record now stored."""
        while True:
            entry = await self.batches.get(batch_id)
            assert entry.value is not None
            assert entry.revision is not None
            current = BatchRecord.decode(entry.value)
            changed = change(current)
            if changed is None:
                return current
            try:
                await self.batches.update(batch_id, changed.encode(), last=entry.revision)
                return changed
            except nats.js.errors.KeyWrongLastSequenceError:
                await asyncio.sleep(0)  # someone else wrote first: read it again


async def _get(kv: KeyValue, key: str) -> bytes | None:
    try:
        entry = await kv.get(key)
    except nats.js.errors.KeyNotFoundError:
        return None
    return entry.value


async def _values(kv: KeyValue) -> dict[str, bytes]:
    """Every live entry. Not ``kv.keys()``: nats-py decides it has seen every
    key from a count the server may already have sent past, and a loaded
    machine then gets no keys at all (``kvwatch.current_entries``)."""
    async with asyncio.timeout(kvwatch.SNAPSHOT_WITHIN):
        return await kvwatch.snapshot(kv)


def bucket_names(config: Config) -> tuple[str, str, str, str]:
    p = config.nats.subject_prefix.upper()
    return f"{p}_FILES", f"{p}_FILEMETA", f"{p}_BATCHES", f"{p}_BATCHOUT"


async def open_stores(js: JetStreamContext, config: Config) -> Stores:
    files_b, meta_b, batches_b, results_b = bucket_names(config)
    ttl = config.batch.file_ttl
    files = await objects.ensure_store(js, files_b, ttl=ttl, replicas=config.streams.replicas,
                                       file_storage=config.streams.storage == "file")
    filemeta = await broker.ensure_bucket(js, config, meta_b, "tidegate: batch API files",
                                          ttl=ttl)
    batches = await broker.ensure_bucket(js, config, batches_b, "tidegate: batches", ttl=ttl)
    results = await broker.ensure_bucket(js, config, results_b,
                                         "tidegate: finished batch lines", ttl=ttl)
    return Stores(config, js, files, filemeta, batches, results)
