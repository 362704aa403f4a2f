"""API key authentication at the edge.

Keys are compared by SHA-256 digest, never as plain strings, so the table can
later be filled from hashed keys in NATS KV (``TG_KEYS``) without changing
callers. A :class:`Principal` is what the rest of the pipeline knows about the
caller: tenant, user and a key id that is safe to log.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass

from tidegate.errors import ApiError


@dataclass(frozen=True, slots=True)
class Principal:
    tenant: str
    user: str
    key_id: str


def key_digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


class KeyTable:
    """Digest -> principal. Lookups are dict hits on a digest, which does not
    leak key contents through timing the way a prefix comparison would."""

    def __init__(self, keys: Iterable[str] = (), tenant: str = "default") -> None:
        self._by_digest: dict[str, Principal] = {}
        for key in keys:
            digest = key_digest(key)
            self._by_digest[digest] = Principal(tenant=tenant, user="", key_id=digest[:12])

    def __len__(self) -> int:
        return len(self._by_digest)

    def authenticate(self, authorization: str | None) -> Principal:
        if not authorization:
            raise ApiError(401, "You didn't provide an API key. Send it as "
                                "'Authorization: Bearer YOUR_KEY'.",
                           type="authentication_error", code="missing_api_key")
        scheme, _, key = authorization.partition(" ")
        key = key.strip()
        if scheme.lower() != "bearer" or not key:
            raise ApiError(401, "Malformed Authorization header: expected 'Bearer YOUR_KEY'.",
                           type="authentication_error", code="invalid_authorization_header")
        principal = self._by_digest.get(key_digest(key))
        if principal is None:
            shown = f"{key[:6]}...{key[-4:]}" if len(key) > 12 else "***"
            raise ApiError(401, f"Incorrect API key provided: {shown}.",
                           type="authentication_error", code="invalid_api_key")
        return principal
