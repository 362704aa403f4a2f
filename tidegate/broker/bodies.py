"""Request bodies larger than a NATS message cross the broker by claim check.

The edge stores the body of a request whose envelope is over
``edge.claim_check_bytes`` in the ``<P>_BODIES`` object store, named by the
request id, and publishes the request with an empty body and ``claim`` naming
it (:func:`check_in`). The dispatcher and the worker read it back before they
look at the body (:func:`resolve`); the worker deletes it once the job is
acked for good (:func:`discard`); a redelivered job still finds it, and the
bucket's TTL (``streams.max_age``, a request's useful life) removes what a
dead tier left. Docs: docs/configuration.md (``edge.claim_check_bytes``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator

import msgpack
from nats.js import JetStreamContext

from tidegate.broker import objects
from tidegate.config import Config
from tidegate.errors import BrokerError, ProtocolError
from tidegate.wire.protocol import ErrorInfo, Request

log = logging.getLogger("tidegate.broker")

# The envelope of a claimed request, less its body, must fit with room to
# spare: the dispatcher's job headers and the JetStream framing ride with it.
_ENVELOPE_ROOM = 64 << 10


class BodyLost(BrokerError):
    """A claimed body is not in the store (its TTL passed, or it was purged)."""


class BodyUnreadable(ProtocolError):
    """A claimed body that is not a msgpack map: the job is poison."""


# What the client is told when that happens (a retry sends the body again).
LOST = ErrorInfo(502, "server_error", "request_body_lost",
                 "The request body was stored for the broker and is gone; send the request "
                 "again.", True, 1.0)


def threshold(config: Config, max_payload: int) -> int:
    """Envelope size above which a request's body is claim-checked."""
    set_ = config.edge.claim_check_bytes
    return min(set_, max_payload - _ENVELOPE_ROOM) if set_ else max_payload // 2


async def ensure(js: JetStreamContext, config: Config) -> None:
    """The bodies' object store, created when missing (admin at setup)."""
    await objects.ensure_store(js, config.nats.subjects.bodies_bucket,
                               ttl=config.streams.max_age, replicas=config.streams.replicas,
                               file_storage=config.streams.storage == "file",
                               description="tidegate: request bodies by claim check")


async def _whole(data: bytes) -> AsyncIterator[bytes]:
    yield data  # objects.put cuts it into chunks


async def check_in(js: JetStreamContext, config: Config, request: Request,
                   max_payload: int) -> Request:
    """``request`` with its body stored and claimed (an empty ``body``,
    ``claim`` set); raises what the store raised. The object is named by the
    request id: a retry of the same request stores the same body again."""
    bucket = config.nats.subjects.bodies_bucket
    data = msgpack.packb(request.body)
    # Chunks as large as a message allows: a 20 MiB body in 40 acked
    # publishes, not 160 of the store's default 128 KiB.
    await objects.put(js, bucket, request.id, _whole(data),
                      chunk_size=max(objects.CHUNK, max_payload // 2))
    return dataclasses.replace(request, body={}, claim=request.id)


async def resolve(js: JetStreamContext, config: Config, request: Request) -> Request:
    """``request`` with its claimed body read back (as is when not claimed).
    Raises :class:`BodyLost` when the object is gone, :class:`BodyUnreadable`
    when it holds no map, BrokerError when the store cannot be read."""
    if not request.claim:
        return request
    bucket = config.nats.subjects.bodies_bucket
    parts: list[bytes] = []
    try:
        async for chunk in objects.read(js, bucket, request.claim):
            parts.append(chunk)
    except objects.NotFound:
        raise BodyLost(f"the body of request {request.id} is no longer stored") from None
    try:
        body = msgpack.unpackb(b"".join(parts))
    except Exception as exc:
        raise BodyUnreadable(f"the stored body of request {request.id}: {exc}") from None
    if not isinstance(body, dict):
        raise BodyUnreadable(f"the stored body of request {request.id} is not a map")
    return dataclasses.replace(request, body=body)


def discard(js: JetStreamContext, config: Config, request: Request) -> None:
    """Delete a claimed body in the background (its job is acked for good);
    a failure leaves it to the bucket's TTL."""
    if request.claim:
        task = asyncio.get_running_loop().create_task(_delete(js, config, request.claim))
        _deleting.add(task)
        task.add_done_callback(_deleting.discard)


_deleting: set[asyncio.Task[None]] = set()  # the loop keeps only weak references


async def _delete(js: JetStreamContext, config: Config, name: str) -> None:
    try:
        await objects.delete(js, config.nats.subjects.bodies_bucket, name)
    except Exception as exc:
        log.info("could not delete the claimed body %s (its TTL will): %s", name, exc)
