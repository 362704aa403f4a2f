"""The desk: edges ask a dispatcher to write a tenant's file and batch records.

An edge's NATS credentials read the batch API's stores but may not write their
records or delete objects: a stolen edge login could otherwise hand one
tenant's file to another, forge a batch that bills a tenant, or purge the
store (docs/security.md). So an edge publishes an upload's chunks only
(:func:`tidegate.broker.objects.put_chunks`, chunk id = file id) and asks on
``<p>.desk`` (request-reply) for the rest. Each :class:`Ask` carries the
client's key as the edge received it: the dispatcher finds the tenant from the
key itself (``dispatcher/batch/desk.py``), so edge credentials act only for
keys their holder has. An answer is a record or an OpenAI error.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import msgpack
import nats.errors
from nats.aio.client import Client

from tidegate.broker.objects import Chunks
from tidegate.errors import ApiError, ProtocolError, unavailable
from tidegate.wire.batch import BatchRecord, FileRecord
from tidegate.wire.subjects import Subjects

FILE, DELETE, DISCARD, BATCH, CANCEL = "file", "delete", "discard", "batch", "cancel"
OPS = frozenset((FILE, DELETE, DISCARD, BATCH, CANCEL))
# Seconds an edge waits for an answer: a desk's work is a few KV and stream
# writes; past this the dispatchers are gone or wedged, and the client retries.
WAIT = 10.0
_AGAIN = 0.25  # seconds between asks while no dispatcher listens


@dataclass(frozen=True, slots=True)
class Ask:
    """One request to the desk.

    ``auth``: the ``Authorization`` value the edge authenticated (``Bearer
    <key>``); ``id``: the file (FILE, DELETE, DISCARD) or batch (CANCEL) id;
    ``chunks``: FILE, what the edge published; ``batch``: BATCH, the record
    as the edge built it (the desk sets its tenant, key and user from ``auth``);
    ``keep_finalizing``: CANCEL, a finalizing batch is left as it is (Anthropic's
    rule: every request has finished) instead of refused.
    """

    op: str
    auth: str
    id: str = ""
    filename: str = ""
    purpose: str = ""
    chunks: Chunks | None = None
    batch: BatchRecord | None = None
    keep_finalizing: bool = False

    def encode(self) -> bytes:
        c = self.chunks
        return msgpack.packb({
            "op": self.op, "auth": self.auth, "id": self.id, "filename": self.filename,
            "purpose": self.purpose, "keep": self.keep_finalizing,
            "chunks": [c.nuid, c.size, c.count, c.digest] if c else None,
            "batch": self.batch.encode() if self.batch else None})

    @classmethod
    def decode(cls, data: bytes) -> Ask:
        """Raises ProtocolError on anything but an Ask (broker input is untrusted)."""
        try:
            m = msgpack.unpackb(data)
            chunks, batch = m["chunks"], m["batch"]
            ask = cls(op=_text(m["op"]), auth=_text(m["auth"]), id=_text(m["id"]),
                      filename=_text(m["filename"]), purpose=_text(m["purpose"]),
                      keep_finalizing=m["keep"] is True,
                      chunks=None if chunks is None else Chunks(
                          _text(chunks[0]), _count(chunks[1]), _count(chunks[2]),
                          _text(chunks[3])),
                      batch=None if batch is None else BatchRecord.decode(batch))
        except ProtocolError:
            raise
        except Exception as exc:
            raise ProtocolError(f"not a desk request: {type(exc).__name__}") from None
        if ask.op not in OPS:
            raise ProtocolError(f"unknown desk operation {ask.op[:32]!r}")
        return ask


def _text(value: Any) -> str:
    if not isinstance(value, str):
        raise ProtocolError("a desk request's field is not text")
    return value


def _count(value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ProtocolError("a desk request's count is not a count")
    return value


def answer(record: bytes) -> bytes:
    """The desk's answer with a record (b"" when there is none)."""
    return msgpack.packb({"ok": record})


def refusal(exc: ApiError) -> bytes:
    """The desk's answer with the error the client is to get."""
    return msgpack.packb({"error": [exc.status, exc.message, exc.type, exc.code, exc.param,
                                    exc.retry_after]})


def read_answer(data: bytes) -> bytes:
    """The record of an answer; raises the ApiError it carries."""
    try:
        m = msgpack.unpackb(data)
        if "ok" in m:
            return bytes(m["ok"])
        status, message, type_, code, param, retry_after = m["error"]
        refused = ApiError(int(status), str(message), type=str(type_), code=code, param=param,
                           retryable=status >= 500, retry_after=float(retry_after))
    except Exception:
        raise ApiError(502, "A dispatcher gave an answer this gateway node cannot read.",
                       type="server_error", code="protocol_error", retryable=True,
                       retry_after=1) from None
    raise refused


def _unanswered() -> ApiError:
    return unavailable("No dispatcher answered to store this change; retry.",
                       code="dispatcher_unavailable", retry_after=5)


class Desk:
    """The edge's side: one method per operation, each an :class:`Ask` and its answer."""

    def __init__(self, nc: Client, subjects: Subjects) -> None:
        self.nc = nc
        self.subject = subjects.desk

    async def ask(self, ask: Ask) -> bytes:
        """The answer within :data:`WAIT` s. While no dispatcher listens (one
        starting or restarting: "no responders", so nobody took the ask) it
        is asked again; a dispatcher that took it and went silent is not
        (it may have done the change), the client gets a retryable 503."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + WAIT
        while True:
            try:
                msg = await self.nc.request(self.subject, ask.encode(),
                                            timeout=max(0.1, deadline - loop.time()))
                break
            except nats.errors.NoRespondersError:
                if loop.time() + _AGAIN >= deadline:
                    raise _unanswered() from None
                await asyncio.sleep(_AGAIN)
            except (nats.errors.TimeoutError, TimeoutError):
                raise _unanswered() from None
        return read_answer(msg.data)

    async def record_file(self, auth: str, file_id: str, filename: str, purpose: str,
                          chunks: Chunks) -> FileRecord:
        """Make the chunks published on ``file_id`` the caller's file."""
        return FileRecord.decode(await self.ask(Ask(FILE, auth, file_id, filename, purpose,
                                                    chunks)))

    async def delete_file(self, auth: str, file_id: str) -> None:
        await self.ask(Ask(DELETE, auth, file_id))

    async def discard(self, auth: str, file_id: str) -> None:
        """Remove what an unfinished upload left: its chunks, and its file if
        it was recorded (idempotent)."""
        await self.ask(Ask(DISCARD, auth, file_id))

    async def create_batch(self, auth: str, batch: BatchRecord) -> BatchRecord:
        return BatchRecord.decode(await self.ask(Ask(BATCH, auth, batch.id, batch=batch)))

    async def cancel_batch(self, auth: str, batch_id: str, *,
                           keep_finalizing: bool = False) -> BatchRecord:
        return BatchRecord.decode(await self.ask(Ask(CANCEL, auth, batch_id,
                                                     keep_finalizing=keep_finalizing)))
