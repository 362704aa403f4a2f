"""Per-tenant settings in NATS KV, changed live: ``tidegate tenant``.

``resumable`` (every streaming request of the tenant is a resumable stream,
docs/resume.md), with an optional ``grace`` in seconds that replaces
``resume.grace`` for the tenant; ``tier``, a ``[[tiers]]`` name that weighs
the tenant in queue mode over the config's tiers (docs/queue-mode.md). The
bucket ``<P>_TENANTS`` holds one JSON value per tenant, keyed by
:func:`tidegate.wire.subjects.encode_token` of its name; every edge and
dispatcher follows it (:func:`watch_tenants`) and applies a change within
about a second, like API keys and policies.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass

import nats.js.errors
from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from tidegate.broker.broker import ensure_bucket
from tidegate.broker.kvwatch import SNAPSHOT_WITHIN, follow_bucket, snapshot
from tidegate.config import Config
from tidegate.errors import ProtocolError
from tidegate.wire.subjects import decode_token, encode_token


def bucket_name(config: Config) -> str:
    return f"{config.nats.subjects.prefix.upper()}_TENANTS"


@dataclass(frozen=True, slots=True)
class TenantSettings:
    tenant: str
    resumable: bool = False
    grace: float | None = None  # seconds; None: resume.grace
    tier: str = ""  # a [[tiers]] name; "": the config's tier for the tenant, if any

    def encode(self) -> bytes:
        return json.dumps({"resumable": self.resumable, "grace": self.grace,
                           "tier": self.tier}).encode()

    @classmethod
    def decode(cls, tenant: str, data: bytes) -> TenantSettings:
        try:
            m = json.loads(data)
            grace = m.get("grace")
            tier = m.get("tier") or ""
            if not isinstance(tier, str):
                raise TypeError(f"tier must be a string, got {tier!r}")
            return cls(tenant, bool(m.get("resumable", False)),
                       None if grace is None else float(grace), tier)
        except (ValueError, TypeError, AttributeError) as exc:
            raise ProtocolError(f"malformed settings of tenant {tenant!r}: {exc}") from exc


class TenantTable:
    """Tenant -> settings, as an edge or a dispatcher knows them (sans-I/O)."""

    def __init__(self) -> None:
        self._by_tenant: dict[str, TenantSettings] = {}

    def get(self, tenant: str) -> TenantSettings | None:
        return self._by_tenant.get(tenant)

    def apply(self, key: str, value: bytes) -> None:
        try:
            tenant = decode_token(key)
            self._by_tenant[tenant] = TenantSettings.decode(tenant, value)
        except (ValueError, ProtocolError):
            return  # not ours to judge: a malformed entry changes nothing

    def remove(self, key: str) -> None:
        try:
            self._by_tenant.pop(decode_token(key), None)
        except ValueError:
            pass


async def ensure_tenants_bucket(js: JetStreamContext, config: Config) -> KeyValue:
    return await ensure_bucket(js, config, bucket_name(config), "tidegate: tenant settings")


async def watch_tenants(kv: KeyValue, table: TenantTable,
                        on_synced: Callable[[], None] | None = None) -> None:
    await follow_bucket(kv, table.apply, table.remove, on_synced=on_synced)


async def set_tenant(kv: KeyValue, settings: TenantSettings) -> None:
    await kv.put(encode_token(settings.tenant), settings.encode())


async def delete_tenant(kv: KeyValue, tenant: str) -> bool:
    try:
        await kv.get(encode_token(tenant))
    except nats.js.errors.KeyNotFoundError:
        return False
    await kv.delete(encode_token(tenant))
    return True


async def list_tenants(kv: KeyValue) -> list[TenantSettings]:
    """Every tenant's settings, by name. Read with ``kvwatch.snapshot``, not
    ``kv.keys()``, which a loaded machine can answer with no keys at all."""
    async with asyncio.timeout(SNAPSHOT_WITHIN):
        entries = await snapshot(kv)
    return sorted((TenantSettings.decode(decode_token(key), value)
                   for key, value in entries.items() if value), key=lambda s: s.tenant)
