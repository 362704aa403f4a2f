"""The operator's changes to control data, checked and audited in one place.

The CLI (``tidegate keys|policy|tenant|batches``) and the browser console both
call these, so they accept the same input and leave the same audit line.

Each function checks its input (:class:`~tidegate.control.admin.UsageError`,
:class:`~tidegate.control.admin.NotFound`), makes the change, then logs one
line on ``tidegate.audit`` at INFO, only when the change happened, e.g.
``audit by=cli action=keys.create key_id=0123456789ab tenant=acme ...``.
``by`` is ``cli`` or ``console:<key_id>``. Values holding a space, ``=`` or a
control character are ``repr``-quoted, so no field can be forged; the line
never holds a key, only its id. Docs: docs/security.md.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Sequence
from typing import Any

from nats.js import JetStreamContext

from tidegate.config import Config
from tidegate.control import keys as tgkeys
from tidegate.control import policies as tgpolicies
from tidegate.control import tenants as tgtenants
from tidegate.control.admin import NotFound, UsageError, check_name
from tidegate.control.batches import open_stores
from tidegate.wire.batch import BATCH_PREFIX, BatchRecord, cancel, valid_id

audit_log = logging.getLogger("tidegate.audit")

_PLAIN = re.compile(r"[^\s=\"'\\\x00-\x1f\x7f]+")


def _value(value: object) -> str:
    text = "-" if value in ("", None) else str(value)
    return text if _PLAIN.fullmatch(text) else repr(text)


def audit(by: str, action: str, **fields: object) -> str:
    """Log (and return) the audit line of one change."""
    line = " ".join([f"audit by={_value(by)} action={action}",
                     *(f"{k}={_value(v)}" for k, v in fields.items())])
    audit_log.info("%s", line)
    return line


def _when(ts: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ts)) if ts else "never"


def model_name(config: Config, name: str) -> str:
    """The configured model's name for a name or alias; others stay as given."""
    model = config.model_index().get(name)
    return name if model is None else model.name


# --------------------------------------------------------------------------
# keys
# --------------------------------------------------------------------------


def check_key_id(key_id: str) -> str:
    """A key id as ``keys list`` shows it: 12 to 64 hex characters."""
    value = key_id.strip().lower()
    if not re.fullmatch(r"[0-9a-f]{12,64}", value):
        raise UsageError(f"a key id is the 12 hex characters `tidegate keys list` shows, "
                         f"got {key_id!r}")
    return value


def key_request(config: Config, tenant: str, user: str = "", models: Sequence[str] = (),
                expires_in: float = 0.0) -> tuple[str, ...]:
    """Check a key's fields before anything is stored; its models' configured names."""
    check_name("tenant", tenant)
    if user:
        check_name("user", user)
    if isinstance(expires_in, bool) or not isinstance(expires_in, int | float) \
            or not 0 <= expires_in < 100 * 365 * 86400:
        raise UsageError(f"expires must be a number of seconds >= 0, got {expires_in!r}")
    names = tuple(dict.fromkeys(model_name(config, m) for m in models))
    try:
        tgkeys.KeyRecord(key_id="", tenant=tenant, user=user, models=names)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    return names


async def create_key(js: JetStreamContext, config: Config, by: str, tenant: str,
                     user: str = "", models: Sequence[str] = (), expires_in: float = 0.0,
                     admin: bool = False) -> tuple[str, tgkeys.KeyRecord]:
    """A new key: (the key, shown once, and its record)."""
    names = key_request(config, tenant, user, models, expires_in)
    kv = await tgkeys.ensure_keys_bucket(js, config)
    key, record = await tgkeys.create_key(kv, tenant, user, names, expires_in=expires_in,
                                          admin=admin)
    audit(by, "keys.create", key_id=record.key_id, tenant=tenant, user=user,
          models=",".join(names) or "all", admin="yes" if admin else "no",
          expires=_when(record.expires))
    return key, record


async def revoke_key(js: JetStreamContext, config: Config, by: str, key_id: str) -> None:
    key_id = check_key_id(key_id)
    kv = await tgkeys.ensure_keys_bucket(js, config)
    try:
        found = await tgkeys.revoke_key(kv, key_id)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if not found:
        raise NotFound(f"no API key with id {key_id} (see `tidegate keys list`)")
    audit(by, "keys.revoke", key_id=key_id)


async def list_keys(js: JetStreamContext, config: Config) -> list[dict[str, Any]]:
    """Every key's record with its last use (0: never), as ``keys list --json``."""
    records = await tgkeys.list_keys(await tgkeys.ensure_keys_bucket(js, config))
    used = await tgkeys.read_last_used(await tgkeys.ensure_last_used_bucket(js, config))
    last = {digest[:tgkeys.KEY_ID_LENGTH]: when for digest, when in used.items()}
    return [{**r.as_dict(), "admin": r.admin, "last_used": last.get(r.key_id, 0.0)}
            for r in records]


# --------------------------------------------------------------------------
# policies
# --------------------------------------------------------------------------


def _limit(name: str, value: object) -> int:
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise UsageError(f"policy set: {name} must be a whole number >= 0 (0 = unlimited), "
                         f"got {value!r}")
    return value


def policy(config: Config, tenant: str = "", model: str = "", user: str = "",
           rpm: object = None, tpm: object = None, concurrency: object = None,
           verb: str = "set") -> tgpolicies.Policy:
    """The checked policy of one scope (limits only for ``set``)."""
    if verb == "set" and rpm is None and tpm is None and concurrency is None:
        raise UsageError("policy set: give at least one limit: --rpm, --tpm or --concurrency")
    for what, name in (("tenant", tenant), ("user", user)):
        if name:
            check_name(f"policy {verb}: {what}", name)
    try:
        found = tgpolicies.Policy(
            tenant=tenant, model=model_name(config, model) if model else "", user=user,
            rpm=_limit("rpm", rpm), tpm=_limit("tpm", tpm),
            concurrency=_limit("concurrency", concurrency))
    except ValueError as exc:
        raise UsageError(f"policy {verb}: {exc}") from None
    if verb == "set" and not found.has_limits:
        raise UsageError("policy set: every limit given is 0 (unlimited); to remove the "
                         "policy use `tidegate policy delete`")
    return found


async def set_policy(js: JetStreamContext, config: Config, by: str,
                     rule: tgpolicies.Policy) -> None:
    kv = await tgpolicies.ensure_policies_bucket(js, config)
    await tgpolicies.set_policy(kv, rule)
    audit(by, "policy.set", tenant=rule.tenant or "*", model=rule.model or "*",
          user=rule.user or "*", rpm=rule.rpm, tpm=rule.tpm, concurrency=rule.concurrency)


async def delete_policy(js: JetStreamContext, config: Config, by: str,
                        probe: tgpolicies.Policy) -> None:
    kv = await tgpolicies.ensure_policies_bucket(js, config)
    if not await tgpolicies.delete_policy(kv, probe.scope_id):
        raise NotFound(f"no policy for {probe.scope_label} (see `tidegate policy list`)")
    audit(by, "policy.delete", tenant=probe.tenant or "*", model=probe.model or "*",
          user=probe.user or "*")


async def list_policies(js: JetStreamContext, config: Config) -> list[dict[str, Any]]:
    kv = await tgpolicies.ensure_policies_bucket(js, config)
    return [p.as_dict() for p in await tgpolicies.list_policies(kv)]


# --------------------------------------------------------------------------
# tenant settings
# --------------------------------------------------------------------------


def tenant_settings(config: Config, tenant: str, resumable: object = False,
                    grace: object = None, tier: object = "") -> tgtenants.TenantSettings:
    check_name("tenant set: tenant", tenant)
    tiers = [t.name for t in config.tiers]
    if not isinstance(tier, str) or (tier and tier not in tiers):
        raise UsageError(f"tenant set: tier must name one of the config's [[tiers]] "
                         f"({', '.join(tiers) or 'none configured'}), got {tier!r}")
    if not isinstance(resumable, bool):
        raise UsageError(f"tenant set: resumable must be true or false, got {resumable!r}")
    if grace is not None and (isinstance(grace, bool) or not isinstance(grace, int | float)):
        raise UsageError(f"tenant set: grace must be a number of seconds, got {grace!r}")
    if grace is not None and not 0 <= grace <= config.resume.max_grace:
        raise UsageError(f"tenant set: --grace must be between 0 and resume.max_grace "
                         f"({config.resume.max_grace:g}), got {grace:g}")
    return tgtenants.TenantSettings(tenant, resumable,
                                    None if grace is None else float(grace), tier)


async def set_tenant(js: JetStreamContext, config: Config, by: str,
                     settings: tgtenants.TenantSettings) -> None:
    await tgtenants.set_tenant(await tgtenants.ensure_tenants_bucket(js, config), settings)
    audit(by, "tenant.set", tenant=settings.tenant,
          resumable="on" if settings.resumable else "off",
          grace="default" if settings.grace is None else f"{settings.grace:g}",
          tier=settings.tier or "default")


async def delete_tenant(js: JetStreamContext, config: Config, by: str, tenant: str) -> None:
    if not tenant.strip():
        raise UsageError("tenant delete: the tenant must not be empty")
    if not await tgtenants.delete_tenant(await tgtenants.ensure_tenants_bucket(js, config),
                                         tenant):
        raise NotFound(f"no settings for tenant {tenant} (see `tidegate tenant list`)")
    audit(by, "tenant.delete", tenant=tenant)


async def list_tenants(js: JetStreamContext, config: Config) -> list[dict[str, Any]]:
    kv = await tgtenants.ensure_tenants_bucket(js, config)
    return [{"tenant": t.tenant, "resumable": t.resumable, "grace": t.grace, "tier": t.tier}
            for t in await tgtenants.list_tenants(kv)]


# --------------------------------------------------------------------------
# batches
# --------------------------------------------------------------------------


def check_batch_id(batch_id: str) -> str:
    if not valid_id(batch_id, BATCH_PREFIX):
        raise UsageError(f"not a batch id: {batch_id!r} (batch_ followed by 32 hex digits)")
    return batch_id


async def cancel_batch(js: JetStreamContext, config: Config, by: str,
                       batch_id: str) -> BatchRecord:
    """The same compare-and-set as a tenant's ``POST /v1/batches/{id}/cancel``."""
    check_batch_id(batch_id)
    stores = await open_stores(js, config)
    batch = None
    if await stores.get_batch(None, batch_id) is not None:
        batch = await stores.update_batch(batch_id, lambda b: cancel(b, int(time.time())))
    if batch is None:
        raise NotFound(f"no batch {batch_id} (see `tidegate batches list`)")
    audit(by, "batches.cancel", batch=batch_id, tenant=batch.tenant, status=batch.status)
    return batch
