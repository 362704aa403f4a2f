"""API keys in NATS KV (tidegate.keys) and the edge's KeyTable fed from it.

The KV tests run against a real nats-server; the watch tests feed a real
KeyTable, so "a created key authenticates within 1 s" is checked on the same
code path the edge uses.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import pytest
from hypothesis import given
from hypothesis import strategies as st
from nats.aio.client import Client as NATS
from nats.js.kv import KeyValue

from edge.auth import KeyTable, Principal
from tests.servers import ServerHandle
from tidegate import config as tgconfig
from tidegate.broker import broker
from tidegate.broker.kvwatch import snapshot
from tidegate.control.keys import (
    KeyRecord,
    create_key,
    ensure_keys_bucket,
    generate_key,
    key_digest,
    list_keys,
    revoke_key,
    watch_keys,
)
from tidegate.errors import ApiError, ProtocolError

STATIC = "sk-static-config-key-0123"


# --------------------------------------------------------------------------
# Pure parts
# --------------------------------------------------------------------------


def test_generated_keys_are_long_urlsafe_and_distinct() -> None:
    keys = {generate_key() for _ in range(200)}
    assert len(keys) == 200
    for key in keys:
        assert key.startswith("sk-tg-")  # the documented prefix (docs/keys-and-policies.md)
        body = key.removeprefix("sk-tg-")
        assert len(body) >= 32
        assert re.fullmatch(r"[A-Za-z0-9_-]+", body)


names = st.text(min_size=1, max_size=30)


@given(tenant=names, user=st.text(max_size=20), models=st.lists(names, max_size=4),
       created=st.floats(min_value=0, max_value=4e9))
def test_record_round_trips(tenant: str, user: str, models: list[str], created: float) -> None:
    record = KeyRecord(key_id="0123456789ab", tenant=tenant, user=user, models=tuple(models),
                       created=created)
    assert KeyRecord.decode(record.encode()) == record
    assert json.loads(record.encode()) == record.as_dict()


@pytest.mark.parametrize("data", [
    b"", b"not json", b"[]", b'{"tenant": "a"}', b'{"key_id": "x"}',
    b'{"key_id": "x", "tenant": ""}',
    b'{"key_id": "x", "tenant": 1}',
    b'{"key_id": "x", "tenant": "a", "models": "gpt"}',
    b'{"key_id": "x", "tenant": "a", "models": [""]}',
    b'{"key_id": "x", "tenant": "a", "created": "yesterday"}',
    b'{"key_id": "x", "tenant": "a", "created": true}',
])
def test_malformed_record_is_a_protocol_error(data: bytes) -> None:
    with pytest.raises(ProtocolError):
        KeyRecord.decode(data)


def test_record_needs_a_tenant() -> None:
    with pytest.raises(ValueError, match="tenant"):
        KeyRecord(key_id="x", tenant="")


def record(tenant: str = "acme", user: str = "", models: tuple[str, ...] = ()) -> KeyRecord:
    return KeyRecord(key_id="ignored", tenant=tenant, user=user, models=models, created=1.0)


def test_key_table_applies_and_removes_kv_keys() -> None:
    table = KeyTable([STATIC])
    key = generate_key()
    digest = key_digest(key)
    with pytest.raises(ApiError):
        table.authenticate(f"Bearer {key}")
    table.apply(digest, record("acme", "alice", ("m1", "m2")))
    assert len(table) == 2
    assert table.authenticate(f"Bearer {key}") == Principal(
        tenant="acme", user="alice", key_id=digest[:12], models=("m1", "m2"))
    table.apply(digest, record("beta"))  # changed in place
    assert table.authenticate(f"Bearer {key}").tenant == "beta"
    assert table.authenticate(f"Bearer {key}").models == ()
    table.remove(digest)
    table.remove(digest)  # idempotent
    with pytest.raises(ApiError) as info:
        table.authenticate(f"Bearer {key}")
    assert info.value.code == "invalid_api_key"
    assert len(table) == 1


def test_static_keys_survive_kv_removal() -> None:
    table = KeyTable([STATIC])
    digest = key_digest(STATIC)
    table.remove(digest)
    assert table.authenticate(f"Bearer {STATIC}").tenant == "default"
    table.apply(digest, record("acme"))  # the config wins over the bucket
    assert table.authenticate(f"Bearer {STATIC}").tenant == "default"
    assert len(table) == 1


# --------------------------------------------------------------------------
# Against nats-server
# --------------------------------------------------------------------------


@dataclass
class Bucket:
    nc: NATS
    kv: KeyValue
    config: tgconfig.Config


@pytest.fixture
async def bucket(nats_server: ServerHandle) -> AsyncIterator[Bucket]:
    config = tgconfig.from_dict({"nats": {"url": nats_server.url}})
    nc = await broker.connect(config.nats, "test-keys")
    try:
        kv = await ensure_keys_bucket(broker.jetstream(nc, config.nats), config)
        yield Bucket(nc, kv, config)
    finally:
        await nc.close()


async def eventually(check: Callable[[], bool], within: float) -> float:
    """Seconds until ``check()`` held; fails after ``within``."""
    start = time.monotonic()
    while not check():
        if time.monotonic() - start > within:
            pytest.fail(f"condition not met within {within}s")
        await asyncio.sleep(0.01)
    return time.monotonic() - start


def accepts(table: KeyTable, key: str) -> bool:
    try:
        table.authenticate(f"Bearer {key}")
    except ApiError:
        return False
    return True


async def test_ensure_bucket_is_idempotent(bucket: Bucket) -> None:
    js = broker.jetstream(bucket.nc, bucket.config.nats)
    again = await ensure_keys_bucket(js, bucket.config)
    status = await again.status()
    assert status.bucket == "TG_KEYS"


async def test_create_list_revoke_round_trip(bucket: Bucket) -> None:
    assert await list_keys(bucket.kv) == []
    key, rec = await create_key(bucket.kv, "acme", "alice", ["m1"], clock=lambda: 100.0)
    key2, rec2 = await create_key(bucket.kv, "beta", clock=lambda: 200.0)
    digest = key_digest(key)
    assert rec == KeyRecord(key_id=digest[:12], tenant="acme", user="alice", models=("m1",),
                            created=100.0)
    # Stored hashed: the KV key is the digest and the key appears nowhere.
    entry = await bucket.kv.get(digest)
    assert KeyRecord.decode(entry.value or b"") == rec
    assert key not in (entry.value or b"").decode()
    stored = list((await snapshot(bucket.kv)).values())
    assert not any(key.encode() in value for value in stored)

    assert await list_keys(bucket.kv) == [rec, rec2]
    assert await revoke_key(bucket.kv, rec.key_id.upper()) is True
    assert await list_keys(bucket.kv) == [rec2]
    assert await revoke_key(bucket.kv, rec.key_id) is False
    assert await revoke_key(bucket.kv, key_digest(key2)) is True  # the full digest works too
    assert await list_keys(bucket.kv) == []


async def test_revoke_rejects_bad_and_ambiguous_ids(bucket: Bucket) -> None:
    for bad in ("xyz", "0123", "g" * 12, ""):
        with pytest.raises(ValueError, match="hex"):
            await revoke_key(bucket.kv, bad)
    prefix = "ab" * 6
    for tail in ("0" * 52, "1" * 52):
        await bucket.kv.put(prefix + tail, record().encode())
    with pytest.raises(ValueError, match="matches 2 keys"):
        await revoke_key(bucket.kv, prefix)
    assert await revoke_key(bucket.kv, prefix + "1") is True
    assert await revoke_key(bucket.kv, prefix) is True


async def test_list_skips_unreadable_records(bucket: Bucket) -> None:
    _, rec = await create_key(bucket.kv, "acme")
    await bucket.kv.put("f" * 64, b"garbage")
    assert await list_keys(bucket.kv) == [rec]


async def test_watch_delivers_existing_then_live_changes(bucket: Bucket) -> None:
    old_key, old = await create_key(bucket.kv, "acme")
    gone_key, _ = await create_key(bucket.kv, "acme")
    await revoke_key(bucket.kv, key_digest(gone_key)[:12])
    events: list[tuple[str, str]] = []
    synced = asyncio.Event()

    def on_put(digest: str, rec: KeyRecord) -> None:
        assert rec.key_id == digest[:12]
        events.append(("put", digest))

    def on_synced() -> None:
        events.append(("synced", ""))
        synced.set()

    task = asyncio.create_task(watch_keys(bucket.kv, on_put,
                                          lambda d: events.append(("delete", d)),
                                          on_synced=on_synced))
    try:
        await asyncio.wait_for(synced.wait(), 5)
        assert ("put", key_digest(old_key)) in events
        assert events[-1] == ("synced", "")
        assert ("put", key_digest(gone_key)) not in events
        events.clear()
        new_key, _ = await create_key(bucket.kv, "beta")
        await eventually(lambda: ("put", key_digest(new_key)) in events, 15.0)
        await revoke_key(bucket.kv, old.key_id)
        await eventually(lambda: ("delete", key_digest(old_key)) in events, 15.0)
        assert events == [("put", key_digest(new_key)), ("delete", key_digest(old_key))]
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert task.cancelled()


async def test_key_table_follows_the_bucket(bucket: Bucket) -> None:
    existing, _ = await create_key(bucket.kv, "acme", models=["m1"])
    table = KeyTable([STATIC])
    synced = asyncio.Event()
    task = asyncio.create_task(watch_keys(bucket.kv, table.apply, table.remove,
                                          on_synced=synced.set))
    try:
        await asyncio.wait_for(synced.wait(), 5)
        assert table.authenticate(f"Bearer {existing}").models == ("m1",)
        key, rec = await create_key(bucket.kv, "beta", "bob")
        await eventually(lambda: accepts(table, key), 15.0)
        principal = table.authenticate(f"Bearer {key}")
        assert (principal.tenant, principal.user, principal.key_id) == ("beta", "bob",
                                                                         rec.key_id)
        await revoke_key(bucket.kv, rec.key_id)
        await eventually(lambda: not accepts(table, key), 15.0)
        assert accepts(table, existing)
        assert accepts(table, STATIC)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_unreadable_record_disables_the_key(bucket: Bucket) -> None:
    key, _ = await create_key(bucket.kv, "acme")
    table = KeyTable()
    task = asyncio.create_task(watch_keys(bucket.kv, table.apply, table.remove))
    try:
        await eventually(lambda: accepts(table, key), 15.0)
        await bucket.kv.put(key_digest(key), b'{"tenant": ""}')
        await eventually(lambda: not accepts(table, key), 15.0)
        await bucket.kv.put("not-a-digest", record().encode())  # ignored, no crash
        key2, _ = await create_key(bucket.kv, "acme")
        await eventually(lambda: accepts(table, key2), 15.0)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_watch_recovers_after_a_nats_restart(nats_server: ServerHandle) -> None:
    """nats-py's own watcher stays silent for 10 s+ after a restart; ours re-watches."""
    config = tgconfig.from_dict({"nats": {"url": nats_server.url}})
    nc = await broker.connect(config.nats, "test-keys-restart")
    task: asyncio.Task[None] | None = None
    try:
        kv = await ensure_keys_bucket(broker.jetstream(nc, config.nats), config)
        before, rec = await create_key(kv, "acme")
        table = KeyTable()
        task = asyncio.create_task(watch_keys(kv, table.apply, table.remove))
        await eventually(lambda: accepts(table, before), 15.0)

        await asyncio.to_thread(nats_server.restart)
        await eventually(lambda: nc.stats["reconnects"] >= 1 and nc.is_connected, 10.0)
        after, _ = await create_key(kv, "acme")
        await revoke_key(kv, rec.key_id)
        # nats-py's own watch stays silent 10 s and more: a ceiling just under
        # it tells ours apart while leaving a loaded machine room.
        took = await eventually(lambda: accepts(table, after) and not accepts(table, before),
                                9.0)
        assert took < 9.0
    finally:
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        await nc.close()
