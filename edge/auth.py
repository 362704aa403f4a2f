"""API key authentication at the edge.

Keys are compared by SHA-256 digest, never as plain strings. Static keys
(``auth.keys``, ``auth.dev_key``: tenant ``default``, any model) always stay
valid; keys from ``<P>_KEYS`` arrive and leave through
:func:`tidegate.control.keys.watch_keys`. A :class:`Principal` is what the
pipeline knows of the caller: tenant, user, allowed models, a loggable key id.

A connection that outlives one request (a WebSocket) re-checks its key per
generation (:meth:`KeyTable.check`) and hears a revoke at once through
:meth:`KeyTable.watch`. Docs: docs/keys-and-policies.md.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from multidict import MultiMapping

from tidegate.control.keys import KEY_ID_LENGTH, KeyRecord, key_digest
from tidegate.errors import ApiError, invalid_request

__all__ = ["KeyListener", "KeyTable", "Principal", "authorization", "key_digest", "single"]


def single(headers: MultiMapping[str], name: str) -> str | None:
    """The value of header ``name``, None without one; 400 when it came more
    than once. Two keys must never mean whichever one a layer happens to read
    (a proxy may add its own after the client's): refused, as gRPC refuses
    repeated ``authorization`` metadata."""
    values = headers.getall(name, ())
    if len(values) > 1:
        raise invalid_request(f"The {name} header was sent more than once; send one key.",
                              param=name, code="duplicate_header")
    return values[0] if values else None


def authorization(headers: MultiMapping[str]) -> str | None:
    """The request's one ``Authorization`` value (see :func:`single`)."""
    return single(headers, "Authorization")


@dataclass(frozen=True, slots=True)
class Principal:
    tenant: str
    user: str
    key_id: str
    models: tuple[str, ...] = ()  # models this key may use; empty = all
    expires: float = 0.0  # Unix time; 0 = never (keys rotated or created with --expires)


#: Told the key's principal now, or None once it was revoked.
KeyListener = Callable[[Principal | None], None]


class KeyTable:
    """Digest -> principal. Lookups are dict hits on a digest, which does not
    leak key contents through timing the way a prefix comparison would."""

    def __init__(self, keys: Iterable[str] = (), tenant: str = "default") -> None:
        self._static: dict[str, Principal] = {}
        self._dynamic: dict[str, Principal] = {}
        # digest -> when this edge last accepted it; flushed to KV by the edge.
        self.last_used: dict[str, float] = {}
        self._listeners: dict[str, set[KeyListener]] = {}
        for key in keys:
            digest = key_digest(key)
            self._static[digest] = Principal(tenant=tenant, user="",
                                             key_id=digest[:KEY_ID_LENGTH])

    def __len__(self) -> int:
        return len(self._static.keys() | self._dynamic.keys())

    def apply(self, digest: str, record: KeyRecord) -> None:
        """Accept the key with this SHA-256 digest (created or changed in KV)."""
        self._dynamic[digest] = Principal(tenant=record.tenant, user=record.user,
                                          key_id=digest[:KEY_ID_LENGTH], models=record.models,
                                          expires=record.expires)
        self._notify(digest)

    def remove(self, digest: str) -> None:
        """Stop accepting the KV key with this digest (revoked). Idempotent."""
        self._dynamic.pop(digest, None)
        self._notify(digest)

    def watch(self, digest: str, listener: KeyListener) -> Callable[[], None]:
        """Call ``listener`` whenever the key with this digest changes or is
        revoked (synchronously, from the KV watch: it must only take note).
        Returns the function that stops it."""
        self._listeners.setdefault(digest, set()).add(listener)

        def stop() -> None:
            listeners = self._listeners.get(digest)
            if listeners is not None:
                listeners.discard(listener)
                if not listeners:
                    del self._listeners[digest]

        return stop

    def _notify(self, digest: str) -> None:
        listeners = self._listeners.get(digest)
        if listeners:
            principal = self._static.get(digest) or self._dynamic.get(digest)
            for listener in list(listeners):
                listener(principal)

    @staticmethod
    def digest_of(authorization: str) -> str:
        """The digest of the key in an ``Authorization`` value that
        :meth:`authenticate` accepted."""
        return key_digest(authorization.partition(" ")[2].strip())

    def check(self, digest: str) -> Principal:
        """The principal of the key with this digest as it is now: 401 if it
        was revoked or has expired since the connection authenticated."""
        principal = self._static.get(digest) or self._dynamic.get(digest)
        if principal is None:
            raise ApiError(401, f"This API key ({digest[:KEY_ID_LENGTH]}) has been revoked.",
                           type="authentication_error", code="revoked_api_key")
        now = time.time()
        if principal.expires and now >= principal.expires:
            raise _expired(principal)
        self.last_used[digest] = now
        return principal

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
        try:
            digest = key_digest(key)
        except UnicodeEncodeError:  # undecodable header bytes: no key has them
            digest = ""
        principal = self._static.get(digest) or self._dynamic.get(digest)
        if principal is None:
            # Not even a masked part of it: a key one typo from a real one
            # would give that one's characters away (issue 24).
            raise ApiError(401, "Incorrect API key provided (it is not repeated here).",
                           type="authentication_error", code="invalid_api_key")
        now = time.time()
        if principal.expires and now >= principal.expires:
            raise _expired(principal)
        self.last_used[digest] = now
        return principal


def _expired(principal: Principal) -> ApiError:
    return ApiError(401, f"This API key ({principal.key_id}) has expired; ask for a new one "
                         "(`tidegate keys rotate`).", type="authentication_error",
                    code="expired_api_key")
