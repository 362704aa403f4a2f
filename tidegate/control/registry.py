"""The mechanics every liveness registry in KV shares (workers, edges): a
memory bucket with a TTL, a heartbeat that puts a snapshot and deletes it on
the way out, and a one-off read of the live entries.

Written once because the two registries had grown the same code twice, and a
bug in one copy (a heartbeat landing during the read's replay counted twice)
had to be fixed in both.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Protocol, TypeVar

import nats.js.errors
from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig, StorageType
from nats.js.kv import KeyValue

from tidegate.broker import broker
from tidegate.broker.kvwatch import SNAPSHOT_IDLE, current_entries
from tidegate.config import Config

log = logging.getLogger("tidegate.control")


class Entry(Protocol):
    """What a registry value carries: when it was put, and its encoding."""

    @property
    def updated(self) -> float: ...

    def encode(self) -> bytes: ...


E = TypeVar("E", bound=Entry)


async def ensure_bucket(js: JetStreamContext, config: Config, bucket: str, description: str,
                        ttl: float) -> KeyValue:
    """Memory storage: a registry is rebuilt by the next heartbeats after a
    NATS restart, and it changes every few seconds."""
    return await broker.patiently(
        lambda: _ensure_bucket(js, config, bucket, description, ttl), f"KV bucket {bucket}")


async def _ensure_bucket(js: JetStreamContext, config: Config, bucket: str, description: str,
                         ttl: float) -> KeyValue:
    try:
        return await js.key_value(bucket)
    except nats.js.errors.BucketNotFoundError:
        if not broker.provisions(js):
            raise broker.NotProvisioned(
                f"KV bucket {bucket} does not exist, and this tier's NATS credentials may not "
                f"create it: run `tidegate setup` (admin credentials) first") from None
    try:
        return await js.create_key_value(KeyValueConfig(
            bucket=bucket, description=description, history=1, ttl=ttl,
            storage=StorageType.MEMORY, replicas=config.streams.replicas))
    except nats.js.errors.BadRequestError:
        return await js.key_value(bucket)  # created concurrently


EARLY_SPACING = 0.5  # seconds: the least time between two puts when woken early


async def heartbeat(kv: KeyValue, snapshot: Callable[[], E], key_of: Callable[[E], str],
                    interval: float, what: str, wake: asyncio.Event | None = None) -> None:
    """Put ``snapshot()`` every ``interval`` until cancelled, then delete the
    entry. A failed put (NATS restarting) is retried at the next beat. With
    ``wake``: setting it sends the next put early (something readers act on
    changed), at most one per ``EARLY_SPACING``."""
    key = ""
    try:
        while True:
            if wake is not None:
                wake.clear()  # before the snapshot: it has every change so far
            info = snapshot()
            key = key_of(info)
            try:
                await kv.put(key, info.encode())
            except Exception as exc:
                log.warning("%s heartbeat failed: %s", what, exc)
            if wake is None:
                await asyncio.sleep(interval)
                continue
            await asyncio.sleep(EARLY_SPACING)
            if not wake.is_set():
                # asyncio.timeout, not wait_for: Python 3.11's wait_for drops a
                # cancel that lands as the wake is set (the pool sets it as it
                # stops), and this loop then never ends: a worker stuck in its
                # shutdown for 65 s until `tidegate up` killed it.
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(max(0.0, interval - EARLY_SPACING)):
                        await wake.wait()
    finally:
        if key:
            with contextlib.suppress(Exception):
                await asyncio.shield(kv.delete(key))


async def read_live(kv: KeyValue, decode: Callable[[bytes], E], key_of: Callable[[E], str],
                    max_age: float, what: str) -> list[E]:
    """Every live entry, once per key, sorted by key. Entries older than
    ``max_age`` (a stale clock or a TTL the server has yet to apply) are left
    out. A heartbeat that lands while the watch replays the bucket comes
    through as a second entry for the same key; the newest one wins (two would
    count a worker's slots twice)."""
    now = time.time()
    out: dict[str, E] = {}
    # A one-off read: its consumer goes 2 s after it (kvwatch.SNAPSHOT_IDLE),
    # not after nats-py's 5 minutes. The batch runner reads the workers'
    # registry twice a second: the soak found 370 consumers on it after 150 s
    # (JetStream refuses every read of a bucket past 1,000).
    watcher = await kv.watchall(ignore_deletes=True, inactive_threshold=SNAPSHOT_IDLE)
    try:
        async for entry in current_entries(watcher):
            if entry.value is None:
                continue
            try:
                info = decode(entry.value)
            except (ValueError, KeyError, TypeError, AttributeError) as exc:
                # JSON that is not an object (AttributeError) as well
                log.warning("ignoring malformed %s entry %s: %s", what, entry.key, exc)
                continue
            key = key_of(info)
            seen = out.get(key)
            if now - info.updated <= max_age and (seen is None or info.updated >= seen.updated):
                out[key] = info
    finally:
        with contextlib.suppress(Exception):
            await watcher.stop()  # type: ignore[no-untyped-call]
    return [out[k] for k in sorted(out)]
