"""Operators' view of batches: ``tidegate batches list|show|cancel``, and the
rows of ``tidegate status``'s batches table (drawn by
:func:`fleet.run.status_view.batches_table`).

Operators see every tenant's batches (the CLI talks to NATS directly, with the
deployment's credentials, not through an API key). A cancel from here is the
same compare-and-set as a tenant's ``POST /v1/batches/{id}/cancel``: the batch
runner notices it within half a second.
"""

from __future__ import annotations

import json
import time
from typing import Any

from nats.js import JetStreamContext

from tidegate.config import Config
from tidegate.control.admin import NotFound, UsageError, print_table, run, timestamp_text
from tidegate.control.batches import open_stores
from tidegate.wire.batch import BATCH_PREFIX, BatchRecord, valid_id


def row(batch: BatchRecord, now: float) -> dict[str, Any]:
    """One batch as the status document and ``batches list --json`` show it."""
    c = batch.counts
    return {"id": batch.id, "tenant": batch.tenant, "status": str(batch.status),
            "endpoint": batch.endpoint, "total": c.total, "completed": c.completed,
            "failed": c.failed, "created_at": batch.created_at,
            "expires_in_s": max(0, round(batch.expires_at - now)) if not batch.terminal
            else 0}


async def active_rows(js: JetStreamContext, config: Config) -> list[dict[str, Any]]:
    """Every batch not yet ended, oldest first (for ``tidegate status``)."""
    stores = await open_stores(js, config)
    now = time.time()
    return [row(b, now) for b in reversed(await stores.list_batches(None)) if not b.terminal]


def _checked(batch_id: str) -> str:
    if not valid_id(batch_id, BATCH_PREFIX):
        raise UsageError(f"not a batch id: {batch_id!r} (batch_ followed by 32 hex digits)")
    return batch_id


def batches_list(config: Config, as_json: bool = False, tenant: str = "",
                 status: str = "") -> int:
    async def work(js: JetStreamContext) -> list[BatchRecord]:
        return await (await open_stores(js, config)).list_batches(tenant or None)

    batches = [b for b in run(config, work) if not status or b.status == status]
    now = time.time()
    if as_json:
        print(json.dumps([row(b, now) for b in batches]))
        return 0
    if not batches:
        print("no batches")
        return 0
    print_table(["BATCH", "TENANT", "STATUS", "DONE/TOTAL", "FAILED", "CREATED"],
           [[b.id, b.tenant, b.status, f"{b.counts.completed + b.counts.failed}/"
             f"{b.counts.total}", b.counts.failed, timestamp_text(b.created_at)] for b in batches])
    return 0


def batches_show(config: Config, batch_id: str) -> int:
    _checked(batch_id)

    async def work(js: JetStreamContext) -> BatchRecord | None:
        return await (await open_stores(js, config)).get_batch(None, batch_id)

    batch = run(config, work)
    if batch is None:
        raise NotFound(f"no batch {batch_id} (see `tidegate batches list`)")
    print(json.dumps({"tenant": batch.tenant, **batch.to_openai()}, indent=2))
    return 0


def batches_cancel(config: Config, batch_id: str) -> int:
    from tidegate.control import operations

    _checked(batch_id)

    async def work(js: JetStreamContext) -> BatchRecord:
        return await operations.cancel_batch(js, config, "cli", batch_id)

    batch = run(config, work)
    print(f"batch {batch_id}: {batch.status}")
    return 0
