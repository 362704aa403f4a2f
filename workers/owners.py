"""Who owns each Responses API response, so only its tenant may continue it.

``previous_response_id`` names a response the backend stored; the backend
knows no tenants. A worker records ``id -> tenant`` in ``<P>_RESPONSES``
(key: a hash of the id; entries live ``streams.responses_max_age``) before
the response's ``Done`` goes out, so a client holding the end can follow
up at once. A job naming an id not recorded for its own tenant gets 404
``previous_response_not_found`` before its backend is called, the answer
an id that never existed gets. Docs: docs/security.md#tenant-isolation.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging

import nats.errors
import nats.js.errors
from nats.js.kv import KeyValue

from tidegate import apis
from tidegate.errors import BackendError
from tidegate.wire.protocol import Request

log = logging.getLogger("tidegate.worker")

# Characters of a client's id echoed in the error (it is the client's own
# input, but a long one would only bloat the error).
_ECHO = 64


def owner_key(response_id: str) -> str:
    """The bucket key of a response id (any characters, any length)."""
    return hashlib.blake2b(response_id.encode("utf-8", "surrogatepass"),
                           digest_size=16).hexdigest()


class ResponseOwners:
    """The owners bucket, as one worker uses it."""

    __slots__ = ("kv", "timeout")

    def __init__(self, kv: KeyValue, timeout: float) -> None:
        self.kv = kv
        self.timeout = timeout  # nats.request_timeout

    async def check(self, request: Request) -> None:
        """Raise 404 unless the earlier response the request names (its
        dialect's ``previous_field``) was recorded for its tenant; 503 when
        the bucket cannot answer. Nothing named: nothing to check."""
        field = apis.of(request.api).previous_field
        given = request.body.get(field) if field else None
        if not isinstance(given, str):
            return
        try:
            entry = await asyncio.wait_for(self.kv.get(owner_key(given)), self.timeout)
            owner = entry.value
        except nats.js.errors.KeyNotFoundError:  # KeyDeletedError too
            owner = None
        except (TimeoutError, nats.errors.Error) as exc:
            raise BackendError(503, "Could not check who owns the previous response; "
                                    "try again.", type="service_unavailable",
                               code="owner_store_unavailable", retryable=True) from exc
        if owner != request.tenant.encode("utf-8", "surrogatepass"):
            shown = given if len(given) <= _ECHO else given[:_ECHO] + "..."
            raise BackendError(404, f"Previous response with id '{shown}' not found.",
                               type="invalid_request_error", param=field,
                               code="previous_response_not_found")

    async def record(self, response_id: str, tenant: str) -> None:
        """Record ``tenant`` as the owner of ``response_id``, awaited (the
        caller sends the response's end after). A failure is logged: that
        response cannot be followed up, and nothing else is lost."""
        try:
            await asyncio.wait_for(
                self.kv.put(owner_key(response_id), tenant.encode("utf-8", "surrogatepass")),
                self.timeout)
        except (TimeoutError, nats.errors.Error) as exc:
            log.warning("could not record the owner of response %.64s: %s", response_id, exc)
