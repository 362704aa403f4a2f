"""``tidegate tenant set|list|delete``: the operator commands over the
tenants bucket (tidegate.control.tenants), in tidegate.control.admin's
conventions (one NATS connection per command, errors as one line)."""

from __future__ import annotations

import json

from nats.js import JetStreamContext

from tidegate.config import Config
from tidegate.control import admin, operations
from tidegate.control.tenants import (
    TenantSettings,
    bucket_name,
    ensure_tenants_bucket,
    list_tenants,
)


def cli_set(config: Config, tenant: str, resumable: bool, grace: float | None,
            tier: str = "") -> int:
    settings = operations.tenant_settings(config, tenant, resumable, grace, tier)

    async def work(js: JetStreamContext) -> None:
        await operations.set_tenant(js, config, "cli", settings)

    admin.run(config, work)
    print(f"set tenant {tenant}: resumable {'on' if resumable else 'off'}"
          + (f", grace {grace:g}s" if grace is not None else "")
          + (f", tier {tier}" if tier else ""))
    return 0


def cli_list(config: Config, as_json: bool = False) -> int:
    async def work(js: JetStreamContext) -> list[TenantSettings]:
        return await list_tenants(await ensure_tenants_bucket(js, config))

    tenants = admin.run(config, work)
    if as_json:
        print(json.dumps([{"tenant": t.tenant, "resumable": t.resumable, "grace": t.grace,
                           "tier": t.tier} for t in tenants]))
        return 0
    if not tenants:
        print(f"no tenant settings in {bucket_name(config)}")
        return 0
    admin.print_table(["TENANT", "RESUMABLE", "GRACE", "TIER"],
                 [[t.tenant, "on" if t.resumable else "off",
                   "-" if t.grace is None else f"{t.grace:g}s", t.tier or "-"]
                  for t in tenants])
    return 0


def cli_delete(config: Config, tenant: str) -> int:
    async def work(js: JetStreamContext) -> None:
        await operations.delete_tenant(js, config, "cli", tenant)

    admin.run(config, work)
    print(f"deleted the settings of tenant {tenant}")
    return 0
