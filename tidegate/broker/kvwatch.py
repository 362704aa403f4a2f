"""Following a JetStream KV bucket: existing entries first, then live changes,
and surviving NATS restarts.

nats-py's ``KeyValue.watchall()`` rides an ephemeral ordered consumer kept in
the server's memory. A NATS restart drops that consumer, and the client only
notices after missing idle heartbeats (10 s or more), so a key revoked right
after a restart would stay valid for that long. :func:`follow_bucket` therefore
checks, whenever the watcher has been quiet for ``check_interval``, whether the
bucket holds a revision the watcher has not delivered; if that lag persists
over two checks it re-creates the watcher. The replay that follows repeats
every live key (callers must be idempotent) and reports keys that vanished
meanwhile as deleted, so the caller's view converges to the bucket's.

:func:`snapshot` reads a bucket's live entries once, for the CLI.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import nats.errors
from nats.js.kv import KV_DEL, KV_PURGE, KeyValue

from tidegate.telemetry.untrusted import BadInput

log = logging.getLogger("tidegate.kvwatch")
_BAD_ENTRY = BadInput("kvwatch", log)

OnPut = Callable[[str, bytes], None]
OnDelete = Callable[[str], None]


# After nats-py's "no more values" marker, how long entries already on their
# way are still taken (see current_entries).
_LATE_ENTRY_GRACE = 0.1


async def current_entries(watcher: Any) -> AsyncIterator[Any]:
    """The entries a fresh watcher replays, up to its "no more values" marker
    and then any that still arrive within a short grace.

    Why the grace: nats-py decides that marker from the consumer's
    ``num_pending`` and its own delivered count. When the server has already
    sent an entry that the client has not yet counted, both read 0 and the
    marker comes *before* that entry; a loaded CI machine hit it, and a live
    worker went missing from ``tidegate status``. Every one-off read of a
    bucket goes through here."""
    async for entry in watcher:
        if entry is None:
            break
        yield entry
    while True:
        try:
            entry = await watcher.updates(timeout=_LATE_ENTRY_GRACE)
        except nats.errors.TimeoutError:
            return
        if entry is not None:
            yield entry


async def wait_synced(synced: asyncio.Event, limit: float, what: str) -> bool:
    """Wait up to ``limit`` seconds for a :func:`follow_bucket`'s ``on_synced``
    (``synced.set``): a tier starts serving or pulling only once it knows the
    bucket's existing entries. Past the limit it logs and goes on (False):
    what arrives later still applies."""
    try:
        async with asyncio.timeout(limit):
            await synced.wait()
    except TimeoutError:
        log.warning("%s not loaded within %.0fs; going on with what has arrived, the rest "
                    "follows", what, limit)
        return False
    return True


#: How long a one-off read of a bucket (:func:`snapshot`) may take at most.
SNAPSHOT_WITHIN = 30.0
#: How long the server keeps a one-off read's consumer once its reader is
#: gone. nats-py's default for a watch is 5 minutes: at 4 listings a second
#: (GET /v1/files, any tenant) the bucket reached JetStream's 1,000-consumer
#: limit, and every later read of it failed, for every tenant.
SNAPSHOT_IDLE = 2.0


async def snapshot(kv: KeyValue) -> dict[str, bytes]:
    """Every live key of the bucket with its value (deleted keys left out).
    Callers bound it with ``asyncio.timeout``."""
    out: dict[str, bytes] = {}
    watcher = await kv.watchall(ignore_deletes=True, inactive_threshold=SNAPSHOT_IDLE)
    try:
        async for entry in current_entries(watcher):
            out[entry.key] = entry.value or b""
    finally:
        await _stop(watcher)
    return out


async def follow_bucket(kv: KeyValue, on_put: OnPut, on_delete: OnDelete | None, *,
                        on_synced: Callable[[], None] | None = None,
                        check_interval: float = 0.5) -> None:
    """Call ``on_put(key, value)`` / ``on_delete(key)`` for every entry, existing
    ones first, then ``on_synced()`` once, then live changes. Runs until
    cancelled; NATS outages are logged and ridden out, never raised, and so
    is a callback that raises on one entry (counted as a bad message).
    Without ``on_delete`` no live key is remembered: a bucket whose keys
    expire by its TTL (no delete marker reaches the watcher) would otherwise
    grow that set for as long as the follow runs."""
    live: set[str] = set()
    synced = False
    while True:
        try:
            watcher = await kv.watchall()
        except Exception as exc:
            log.warning("cannot watch KV bucket %s (%s); retrying", _bucket(kv), exc)
            await asyncio.sleep(check_interval)
            continue
        try:
            live = await _follow(kv, watcher, live, on_put, on_delete,
                                 None if synced else on_synced, check_interval)
            synced = True  # _follow only returns after a full replay
        finally:
            await _stop(watcher)
        log.info("re-watching KV bucket %s (its watcher stalled, e.g. after a NATS restart)",
                 _bucket(kv))


async def _follow(kv: KeyValue, watcher: Any, before: set[str], on_put: OnPut,
                  on_delete: OnDelete | None, on_synced: Callable[[], None] | None,
                  check_interval: float) -> set[str]:
    """Follow one watcher until it stalls (then return the live keys) or the
    task is cancelled."""
    live: set[str] = set()
    replayed: set[str] = set()  # every key the replay mentioned, live or deleted
    replaying = True
    last_revision = 0
    lagging = False
    while True:
        try:
            async with asyncio.timeout(check_interval):
                entry = await anext(watcher)
        except TimeoutError:
            if replaying:
                continue  # the end-of-replay marker always comes
            behind = await _behind(kv, last_revision)
            if behind and lagging:
                return live
            lagging = behind
            continue
        except StopAsyncIteration:
            return live
        lagging = False
        if entry is None:
            if replaying:
                replaying = False
                # Keys live before a re-watch that the replay did not repeat
                # were removed without a trace (e.g. purged): report them.
                if on_delete is not None:
                    for key in before - replayed:
                        on_delete(key)
                if on_synced is not None:
                    on_synced()
            continue
        last_revision = max(last_revision, entry.revision or 0)
        if replaying and on_delete is not None:
            replayed.add(entry.key)
        try:
            if entry.operation in (KV_DEL, KV_PURGE):
                live.discard(entry.key)
                if on_delete is not None:
                    on_delete(entry.key)
            else:
                if on_delete is not None:
                    live.add(entry.key)
                on_put(entry.key, entry.value or b"")
        except Exception as exc:
            # One entry a callback cannot take (a hostile or corrupt record)
            # must not end the follow: every later change would be missed,
            # or the tier's task group would stop the tier.
            _BAD_ENTRY.drop(f"kv:{_bucket(kv)}", "poison", f"{type(exc).__name__}: {exc}")


async def _behind(kv: KeyValue, last_revision: int) -> bool:
    """True when the bucket holds a revision newer than ``last_revision``."""
    try:
        state = (await kv.status()).stream_info.state
    except Exception as exc:  # NATS down: nothing to compare, and nothing to re-watch from
        log.debug("KV status of %s unavailable: %s", _bucket(kv), exc)
        return False
    # After a stream purge, last_seq stays while no message is left to deliver.
    return bool(state.messages) and state.last_seq > last_revision


async def _stop(watcher: Any) -> None:
    with contextlib.suppress(Exception):
        await watcher.stop()


def _bucket(kv: KeyValue) -> str:
    return str(getattr(kv, "_name", "?"))
