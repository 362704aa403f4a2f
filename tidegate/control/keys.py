"""API keys in the NATS KV bucket ``<P>_KEYS``.

Keys are stored hashed: the KV key is the SHA-256 hex digest of the API key,
the value a JSON :class:`KeyRecord`. The plain key exists only in the output of
``tidegate keys create``. ``key_id`` (the digest's first 12 hex characters) is
what logs, ``keys list`` and ``keys revoke`` use: it names a key without
revealing it.

Edges follow the bucket with :func:`watch_keys`; a created or revoked key takes
effect there within a second, with no restart.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import re
import secrets
import time
from collections.abc import Callable, Iterable
from typing import Any

from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from tidegate.broker.broker import ensure_bucket
from tidegate.broker.kvwatch import follow_bucket, snapshot
from tidegate.config import Config
from tidegate.errors import ProtocolError

log = logging.getLogger("tidegate.keys")

KEY_PREFIX = "sk-tg-"
KEY_ID_LENGTH = 12
_DIGEST = re.compile(r"[0-9a-f]{64}")
_KEY_ID = re.compile(r"[0-9a-f]{1,64}")


def key_digest(key: str) -> str:
    """SHA-256 hex digest of an API key: its KV key and its identity everywhere."""
    return hashlib.sha256(key.encode()).hexdigest()


def generate_key() -> str:
    """A new API key: ``sk-tg-`` and 43 URL-safe characters (256 random bits)."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


@dataclasses.dataclass(frozen=True, slots=True)
class KeyRecord:
    """What the gateway knows about one API key; never the key itself."""

    key_id: str
    tenant: str
    user: str = ""
    models: tuple[str, ...] = ()  # allowed models; empty = all
    created: float = 0.0  # Unix time
    expires: float = 0.0  # Unix time after which the edge refuses the key; 0 = never
    # An admin key (``keys create --admin``) may also use the operator console
    # (fleet.run.console); a tenant key never may.
    admin: bool = False

    def expired(self, now: float) -> bool:
        return bool(self.expires) and now >= self.expires

    def __post_init__(self) -> None:
        if not self.tenant:
            raise ValueError("a key needs a tenant")
        if any(not m for m in self.models):
            raise ValueError("model names must not be empty")

    def encode(self) -> bytes:
        return json.dumps(self.as_dict(), separators=(",", ":")).encode()

    @classmethod
    def decode(cls, data: bytes) -> KeyRecord:
        try:
            raw = json.loads(data)
            if not isinstance(raw, dict):
                raise TypeError("not an object")
            key_id, tenant, user = raw["key_id"], raw["tenant"], raw.get("user", "")
            models, created = raw.get("models", []), raw.get("created", 0.0)
            expires, admin = raw.get("expires", 0.0), raw.get("admin", False)
            if not isinstance(admin, bool):
                raise TypeError("admin must be true or false")
            if not all(isinstance(v, str) for v in (key_id, tenant, user)):
                raise TypeError("key_id, tenant and user must be strings")
            if not isinstance(models, list) or not all(isinstance(m, str) for m in models):
                raise TypeError("models must be a list of strings")
            for name, value in (("created", created), ("expires", expires)):
                if isinstance(value, bool) or not isinstance(value, int | float):
                    raise TypeError(f"{name} must be a number")
            return cls(key_id=key_id, tenant=tenant, user=user, models=tuple(models),
                       created=float(created), expires=float(expires), admin=admin)
        except (ValueError, TypeError, KeyError) as exc:
            raise ProtocolError(f"malformed key record: {exc}") from None

    def as_dict(self) -> dict[str, Any]:
        return {"key_id": self.key_id, "tenant": self.tenant, "user": self.user,
                "models": list(self.models), "created": self.created, "expires": self.expires,
                # Written only when set: records of tenant keys stay as they were.
                **({"admin": True} if self.admin else {})}


async def ensure_keys_bucket(js: JetStreamContext, config: Config) -> KeyValue:
    """The ``<P>_KEYS`` bucket, created when missing. Idempotent."""
    return await ensure_bucket(js, config, config.nats.subjects.keys_bucket,
                               "tidegate: API keys by SHA-256 digest")


async def create_key(kv: KeyValue, tenant: str, user: str = "", models: Iterable[str] = (),
                     *, clock: Callable[[], float] = time.time,
                     expires_in: float = 0.0, admin: bool = False) -> tuple[str, KeyRecord]:
    """Store a new key; returns the plain key (shown once) and its record.
    ``expires_in`` seconds from now the edge stops accepting it (0 = never);
    ``admin``: the key may also use the operator console."""
    key = generate_key()
    digest = key_digest(key)
    now = clock()
    record = KeyRecord(key_id=digest[:KEY_ID_LENGTH], tenant=tenant, user=user,
                       models=tuple(models), created=now,
                       expires=now + expires_in if expires_in > 0 else 0.0, admin=admin)
    await kv.create(digest, record.encode())
    return key, record


async def list_keys(kv: KeyValue) -> list[KeyRecord]:
    """Every key's record, oldest first. Unreadable records are logged and skipped."""
    records = []
    for digest, value in (await snapshot(kv)).items():
        try:
            records.append(KeyRecord.decode(value))
        except ProtocolError as exc:
            log.warning("skipping key %s: %s", digest[:KEY_ID_LENGTH], exc)
    return sorted(records, key=lambda r: (r.created, r.key_id))


async def revoke_key(kv: KeyValue, key_id: str) -> bool:
    """Delete the key whose digest starts with ``key_id``; False if there is none.

    ``key_id`` is normally the 12-character id; any longer digest prefix works
    too. Raises ``ValueError`` if it is not hex or names more than one key.
    """
    key_id = key_id.strip().lower()
    if not _KEY_ID.fullmatch(key_id) or len(key_id) < KEY_ID_LENGTH:
        raise ValueError(f"a key id is {KEY_ID_LENGTH} to 64 hex characters, got {key_id!r}")
    matches = [d for d in await snapshot(kv) if d.startswith(key_id)]
    if len(matches) > 1:
        raise ValueError(f"key id {key_id} matches {len(matches)} keys; give more of the digest")
    if not matches:
        return False
    await kv.delete(matches[0])
    return True


def last_used_bucket(config: Config) -> str:
    """KV bucket of when each key was last accepted (key: digest, value: Unix
    time as text). Separate from ``<P>_KEYS``: edges write it, and edges may
    not write keys (tidegate.broker.permissions)."""
    return f"{config.nats.subjects.prefix.upper()}_KEYUSE"


async def ensure_last_used_bucket(js: JetStreamContext, config: Config) -> KeyValue:
    return await ensure_bucket(js, config, last_used_bucket(config),
                               "tidegate: when each API key was last used")


async def record_last_used(kv: KeyValue, used: dict[str, float]) -> None:
    """Store the times in ``used`` (digest -> Unix time), then clear it. Called
    by each edge every few seconds, so a busy key costs one put per interval."""
    batch = dict(used)
    used.clear()
    for digest, when in batch.items():
        await kv.put(digest, f"{when:.0f}".encode())


async def read_last_used(kv: KeyValue) -> dict[str, float]:
    out: dict[str, float] = {}
    for digest, value in (await snapshot(kv)).items():
        try:
            out[digest] = float(value)
        except ValueError:
            continue
    return out


async def _find(kv: KeyValue, key_id: str) -> tuple[str, KeyRecord] | None:
    key_id = key_id.strip().lower()
    if not _KEY_ID.fullmatch(key_id) or len(key_id) < KEY_ID_LENGTH:
        raise ValueError(f"a key id is {KEY_ID_LENGTH} to 64 hex characters, got {key_id!r}")
    found = {d: v for d, v in (await snapshot(kv)).items() if d.startswith(key_id)}
    if len(found) > 1:
        raise ValueError(f"key id {key_id} matches {len(found)} keys; give more of the digest")
    if not found:
        return None
    digest, value = next(iter(found.items()))
    return digest, KeyRecord.decode(value)


async def rotate_key(kv: KeyValue, key_id: str, overlap: float, *,
                     clock: Callable[[], float] = time.time,
                     expires_in: float = 0.0) -> tuple[str, KeyRecord, KeyRecord] | None:
    """A new key with the same tenant, user and models; the old one keeps
    working for ``overlap`` seconds (so clients can switch), then expires.
    Returns (new key, its record, the old record as updated), or None if no
    key has that id."""
    found = await _find(kv, key_id)
    if found is None:
        return None
    digest, old = found
    now = clock()
    end = now + max(overlap, 0.0)
    if old.expires:
        end = min(end, old.expires)  # rotation never extends a key's life
    key, new = await create_key(kv, old.tenant, old.user, old.models, clock=clock,
                                expires_in=expires_in, admin=old.admin)
    updated = dataclasses.replace(old, expires=end)
    await kv.put(digest, updated.encode())
    return key, new, updated


async def watch_keys(kv: KeyValue, on_put: Callable[[str, KeyRecord], None],
                     on_delete: Callable[[str], None], *,
                     on_synced: Callable[[], None] | None = None) -> None:
    """Call ``on_put(digest, record)`` for every key and ``on_delete(digest)``
    for every revoked one: existing keys first, then ``on_synced()`` once, then
    live changes. Both callbacks must be idempotent (a re-watch after a NATS
    restart repeats them). A record that cannot be read is treated as revoked:
    an unreadable key must not keep working. Runs until cancelled."""

    def put(digest: str, value: bytes) -> None:
        if not _DIGEST.fullmatch(digest):
            log.warning("ignoring KV key %r in the keys bucket: not a SHA-256 digest", digest)
            return
        try:
            record = KeyRecord.decode(value)
        except ProtocolError as exc:
            log.warning("key %s disabled: %s", digest[:KEY_ID_LENGTH], exc)
            on_delete(digest)
            return
        if record.key_id != digest[:KEY_ID_LENGTH]:
            # The digest is the key's identity; a record cannot claim another id.
            record = dataclasses.replace(record, key_id=digest[:KEY_ID_LENGTH])
        on_put(digest, record)

    await follow_bucket(kv, put, on_delete, on_synced=on_synced)
