"""``tidegate keys`` and ``tidegate policy``: the commands over API keys and
quota policies (the work itself is tidegate.control.operations, shared with
the console; the connection and error contract is tidegate.control.admin's).
Output is a plain table, or JSON with ``--json``."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence
from typing import Any

from nats.js import JetStreamContext

from tidegate.config import Config
from tidegate.control import keys as tgkeys
from tidegate.control import operations
from tidegate.control import policies as tgpolicies
from tidegate.control.admin import (
    NotFound,
    UsageError,
    canonical_model,
    print_table,
    run,
    timestamp_text,
)


def keys_create(config: Config, tenant: str, user: str = "", models: Sequence[str] = (),
                as_json: bool = False, expires_in: float = 0.0, admin: bool = False) -> int:
    models = tuple(dict.fromkeys(canonical_model(config, m) for m in models))
    operations.key_request(config, tenant, user, models, expires_in)  # before connecting

    async def work(js: JetStreamContext) -> tuple[str, tgkeys.KeyRecord]:
        return await operations.create_key(js, config, "cli", tenant, user, models,
                                           expires_in, admin)

    key, record = run(config, work)
    if as_json:
        print(json.dumps({"key": key, **record.as_dict()}))
    else:
        print(f"key:     {key}")
        print(f"key_id:  {record.key_id}")
        print(f"tenant:  {record.tenant}")
        print(f"user:    {record.user or '-'}")
        print(f"models:  {','.join(record.models) or 'all'}")
        print(f"expires: {timestamp_text(record.expires) if record.expires else 'never'}")
        if record.admin:
            print("admin:   yes (may use the operator console)")
    print("Store the key now: it is not shown again (tidegate keeps only its SHA-256 "
          "digest).", file=sys.stderr)
    return 0


def keys_list(config: Config, as_json: bool = False) -> int:
    async def work(js: JetStreamContext) -> tuple[list[tgkeys.KeyRecord], dict[str, float]]:
        records = await tgkeys.list_keys(await tgkeys.ensure_keys_bucket(js, config))
        used = await tgkeys.read_last_used(await tgkeys.ensure_last_used_bucket(js, config))
        return records, {digest[:tgkeys.KEY_ID_LENGTH]: when for digest, when in used.items()}

    records, last_used = run(config, work)
    if as_json:
        print(json.dumps([{**r.as_dict(), "last_used": last_used.get(r.key_id, 0.0)}
                          for r in records]))
        return 0
    if not records:
        print(f"no API keys in {config.nats.subjects.keys_bucket}")
        return 0
    now = time.time()
    print_table(["KEY_ID", "TENANT", "USER", "MODELS", "ADMIN", "CREATED", "EXPIRES", "LAST_USED"],
           [[r.key_id, r.tenant, r.user or "-", ",".join(r.models) or "all",
             "yes" if r.admin else "no",
             timestamp_text(r.created),
             ("expired " if r.expired(now) else "") + timestamp_text(r.expires)
             if r.expires else "never",
             timestamp_text(last_used[r.key_id]) if r.key_id in last_used else "never"]
            for r in records])
    return 0


def keys_rotate(config: Config, key_id: str, overlap: float, expires_in: float = 0.0,
                as_json: bool = False) -> int:
    """A new key for the same tenant, user and models; the old one expires
    after ``overlap`` seconds."""
    async def work(js: JetStreamContext) -> Any:
        kv = await tgkeys.ensure_keys_bucket(js, config)
        return await tgkeys.rotate_key(kv, key_id, overlap, expires_in=expires_in)

    try:
        result = run(config, work)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if result is None:
        raise NotFound(f"no API key with id {key_id} (see `tidegate keys list`)")
    key, new, old = result
    if as_json:
        print(json.dumps({"key": key, **new.as_dict(), "replaces": old.as_dict()}))
    else:
        print(f"key:     {key}")
        print(f"key_id:  {new.key_id}")
        print(f"tenant:  {new.tenant}")
        print(f"replaces {old.key_id}, which stops working at {timestamp_text(old.expires)}")
    print("Store the key now: it is not shown again.", file=sys.stderr)
    return 0


def keys_revoke(config: Config, key_id: str) -> int:
    operations.check_key_id(key_id)

    async def work(js: JetStreamContext) -> None:
        await operations.revoke_key(js, config, "cli", key_id)

    run(config, work)
    print(f"revoked key {key_id}")
    return 0


# --------------------------------------------------------------------------
# policy
# --------------------------------------------------------------------------


def policy_set(config: Config, tenant: str = "", model: str = "", user: str = "",
               rpm: int | None = None, tpm: int | None = None,
               concurrency: int | None = None) -> int:
    if model:
        canonical_model(config, model)  # the note on an unknown model
    policy = operations.policy(config, tenant, model, user, rpm, tpm, concurrency)

    async def work(js: JetStreamContext) -> None:
        await operations.set_policy(js, config, "cli", policy)

    run(config, work)
    print(f"set policy for {policy.scope_label}: {_limits(policy)}")
    return 0


def policy_list(config: Config, as_json: bool = False) -> int:
    async def work(js: JetStreamContext) -> list[tgpolicies.Policy]:
        return await tgpolicies.list_policies(
            await tgpolicies.ensure_policies_bucket(js, config))

    policies = run(config, work)
    if as_json:
        print(json.dumps([p.as_dict() for p in policies]))
        return 0
    if not policies:
        print(f"no policies in {config.nats.subjects.policies_bucket}")
        return 0
    print_table(["TENANT", "MODEL", "USER", "RPM", "TPM", "CONCURRENCY"],
           [[p.tenant or "*", p.model or "*", p.user or "*", *(_limit(v) for v in
             (p.rpm, p.tpm, p.concurrency))] for p in policies])
    return 0


def policy_delete(config: Config, tenant: str = "", model: str = "", user: str = "") -> int:
    if model:
        canonical_model(config, model)
    probe = operations.policy(config, tenant, model, user, verb="delete")

    async def work(js: JetStreamContext) -> None:
        await operations.delete_policy(js, config, "cli", probe)

    run(config, work)
    print(f"deleted policy for {probe.scope_label}")
    return 0


# --------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------


def _limit(value: int) -> str:
    return str(value) if value else "-"


def _limits(policy: tgpolicies.Policy) -> str:
    return ", ".join(f"{name} {getattr(policy, name) or 'unlimited'}"
                     for name in tgpolicies.LIMITS)
