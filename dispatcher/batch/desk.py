"""The desk's dispatcher side: a tenant's file and batch records, written for edges.

Every dispatcher answers ``<p>.desk`` (one queue group) with the batch
runner's stores and keys (tidegate.control.desk says why edges ask). The
invariant: a record is written only for the tenant of the key the request
carries, checked here against the keys bucket; what the edge sent in a record
for tenant, key and user is replaced, and an id that is taken is refused, so
edge credentials without a tenant's key can neither give away, forge nor
delete that tenant's files and batches. Docs: docs/security.md.
"""

from __future__ import annotations

import asyncio
import logging
import time

import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.aio.msg import Msg

from dispatcher.batch.keys import BatchKeys, Holder
from tidegate.broker import objects
from tidegate.config import Config
from tidegate.control import desk
from tidegate.control.batches import Stores
from tidegate.errors import ApiError, ProtocolError, invalid_request, no_such, unavailable
from tidegate.telemetry.untrusted import BadInput
from tidegate.wire.batch import (
    BATCH_PREFIX,
    FILE_PREFIX,
    BatchRecord,
    BatchStatus,
    Counts,
    FileRecord,
    TransitionError,
    cancel,
    new_file_id,
    valid_id,
)

log = logging.getLogger("tidegate.batch")
_BAD_INPUT = BadInput("dispatcher", log)


def _forged(why: str) -> ApiError:
    """The answer to an ask no edge makes (its ids are fresh and its own):
    a stolen edge login's, most likely. Nothing was written."""
    return ApiError(502, f"The dispatcher refused a request no edge makes: {why}.",
                    type="server_error", code="protocol_error")


# How long an ask waits for a starting dispatcher to read the keys bucket
# before it is refused (503, retry): half the edge's desk.WAIT, so the
# refusal reaches the edge before the edge gives up on the ask.
KEYS_WAIT = desk.WAIT / 2


class Desk:
    """Answers each :class:`tidegate.control.desk.Ask` with a record or an error."""

    def __init__(self, config: Config, nc: Client, stores: Stores, keys: BatchKeys) -> None:
        self.config = config
        self.nc = nc
        self.stores = stores
        self.keys = keys
        self.keys_wait = KEYS_WAIT

    async def on_message(self, msg: Msg) -> None:
        if not msg.reply:
            return  # nobody to answer: a request is always asked, never told
        try:
            ask = desk.Ask.decode(msg.data)
            reply = desk.answer(await self.answer(ask))
        except ProtocolError as exc:
            _BAD_INPUT.drop("desk", "malformed", str(exc))  # counted, logged at most every 10 s
            return
        except ApiError as exc:
            reply = desk.refusal(exc)
        except (nats.errors.Error, nats.js.errors.Error, TimeoutError) as exc:
            log.warning("desk: broker error (%s); the edge is told to retry", exc)
            reply = desk.refusal(unavailable("The batch API's stores did not answer; retry.",
                                             retry_after=1))
        except Exception:
            # A record nobody foresaw must not leave its edge waiting out desk.WAIT.
            log.exception("desk: a request failed")
            reply = desk.refusal(ApiError(500, "The dispatcher could not store this change.",
                                          type="server_error", code="internal_error"))
        try:
            await self.nc.publish(msg.reply, reply)
        except nats.errors.Error as exc:
            log.warning("desk: could not answer: %s", exc)

    async def answer(self, ask: desk.Ask) -> bytes:
        """The record the operation leaves (b"" for none); ApiError when refused."""
        # The desk answers from the moment the dispatcher starts, which can
        # be before its first read of the keys: an upload made then waits
        # for that read instead of failing (CI at 0749c7f: a 503 on a test's
        # first upload).
        try:
            await asyncio.wait_for(self.keys.synced.wait(), self.keys_wait)
        except TimeoutError:
            raise unavailable("This dispatcher has not read the API keys yet; retry.",
                              retry_after=1) from None
        holder = self.keys.holder(ask.auth)
        if ask.op == desk.BATCH:
            if ask.batch is None:
                raise _forged("a batch request without its batch")
            return (await self._create_batch(holder, ask.batch)).encode()
        if ask.op == desk.CANCEL:
            if not valid_id(ask.id, BATCH_PREFIX):
                raise no_such("Batch", ask.id)
            return (await self._cancel(holder, ask.id, ask.keep_finalizing)).encode()
        if not valid_id(ask.id, FILE_PREFIX):
            raise no_such("File", ask.id)
        if ask.op == desk.FILE:
            if ask.chunks is None:
                raise _forged("a file request without its chunks")
            return (await self._record(holder, ask)).encode()
        if ask.op == desk.DELETE:
            if await self.stores.get_file(holder.tenant, ask.id) is None:
                raise no_such("File", ask.id)
            await self.stores.delete_file(ask.id)
            log.info("file %s deleted by tenant %s", ask.id, holder.tenant)
        else:
            await self._discard(holder, ask.id)
        return b""

    async def _record(self, holder: Holder, ask: desk.Ask) -> FileRecord:
        assert ask.chunks is not None
        if ask.purpose != "batch":
            raise invalid_request(f"purpose must be 'batch', got {ask.purpose[:32]!r}.",
                                  param="purpose")
        if ask.chunks.nuid != ask.id:
            raise _forged("chunks not published under the file's id")
        # A taken id is refused: sealing over it would give that file's name
        # to these chunks (the edge picks a fresh random id for each upload).
        store = self.stores.files_bucket
        if await objects.exists(self.stores.js, store, ask.id):
            raise _forged("the file exists")
        now = int(time.time())
        file = FileRecord(id=ask.id, tenant=holder.tenant, size=ask.chunks.size,
                          created_at=now, filename=ask.filename[:256], purpose=ask.purpose,
                          expires_at=now + int(self.config.batch.file_ttl))
        try:
            await self.stores.filemeta.create(file.id, file.encode())
        except nats.js.errors.KeyWrongLastSequenceError:
            raise _forged("the file exists") from None
        await objects.seal(self.stores.js, store, file.id, ask.chunks)
        log.info("file %s recorded for tenant %s: %d bytes", file.id, holder.tenant, file.size)
        return file

    async def _discard(self, holder: Holder, file_id: str) -> None:
        """An unfinished upload's remains: its file if the holder's tenant
        owns it, else only chunks no file names (another tenant's file is
        never touched)."""
        file = await self.stores.get_file(holder.tenant, file_id)
        if file is not None:
            await self.stores.delete_file(file_id)
        elif await self.stores.filemeta_entry(file_id) is None:
            await objects.purge_chunks(self.stores.js, self.stores.files_bucket, file_id)

    async def _create_batch(self, holder: Holder, batch: BatchRecord) -> BatchRecord:
        if not valid_id(batch.id, BATCH_PREFIX):
            raise _forged("a batch id not made by an edge")
        if await self.stores.get_file(holder.tenant, batch.input_file_id) is None:
            raise no_such("File", batch.input_file_id)
        # Only what the client chose is taken from the edge's record: the
        # creator from the key, the state new, and output files of fresh ids
        # (an id named by the edge could be another tenant's file, which the
        # runner would overwrite with this batch's output).
        now = int(time.time())
        batch = BatchRecord(
            id=batch.id, tenant=holder.tenant, key_id=holder.key_id, user=holder.user,
            endpoint=batch.endpoint, input_file_id=batch.input_file_id,
            completion_window=batch.completion_window, created_at=now,
            expires_at=now + max(0, min(batch.expires_at - batch.created_at,
                                        int(self.config.batch.max_window))),
            output_file_id=new_file_id(), error_file_id=new_file_id(),
            metadata=batch.metadata, counts=Counts(total=batch.counts.total))
        try:
            await self.stores.create_batch(batch)
        except nats.js.errors.KeyWrongLastSequenceError:
            raise _forged("the batch exists") from None
        log.info("batch %s created by tenant %s from %s", batch.id, holder.tenant,
                 batch.input_file_id)
        return batch

    async def _cancel(self, holder: Holder, batch_id: str, keep_finalizing: bool) -> BatchRecord:
        if await self.stores.get_batch(holder.tenant, batch_id) is None:
            raise no_such("Batch", batch_id)

        def change(current: BatchRecord) -> BatchRecord | None:
            if keep_finalizing and current.status is BatchStatus.FINALIZING:
                return None  # every request has finished: nothing is left to cancel
            try:
                return cancel(current, int(time.time()))
            except TransitionError:
                raise ApiError(409, f"Cannot cancel a batch with status {current.status}.",
                               type="invalid_request_error",
                               code="batch_not_cancellable") from None

        updated = await self.stores.update_batch(batch_id, change)
        log.info("batch %s: cancel requested by tenant %s", batch_id, holder.tenant)
        return updated
