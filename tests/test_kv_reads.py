"""One-off reads of a KV bucket that the CLI and the Files and Batches API
serve from: nats-py's ``kv.keys()`` decides it has seen every key from a
count the server may already have sent past, and a loaded machine then got
no keys at all (``tests/test_spend_cli.py`` in a full run). These reads go
through ``tidegate.broker.kvwatch.snapshot``, which takes what still arrives
after nats-py's "no more values" marker. The fake watcher hands out its
marker before every entry, as that race does."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import nats
import pytest
from nats.js.kv import KV_DEL, KeyValue

from tests.test_workers_registry_read import _KV, _Entry, _Watcher
from tidegate.broker.kvwatch import _follow, snapshot
from tidegate.control import batches, workers_registry
from tidegate.control.tenants import TenantSettings, list_tenants
from tidegate.wire.subjects import encode_token


async def test_tenants_arriving_after_the_marker_are_listed() -> None:
    late = [_Entry(encode_token(t), TenantSettings(t, resumable=True).encode())
            for t in ("beta", "acme")]
    tenants = await list_tenants(_KV(_Watcher([], late)))  # type: ignore[arg-type]
    assert [(t.tenant, t.resumable) for t in tenants] == [("acme", True), ("beta", True)]


async def test_batch_records_arriving_after_the_marker_are_read() -> None:
    kv = _KV(_Watcher([_Entry("batch_1", b"one")], [_Entry("batch_2", b"two")]))
    assert await batches._values(kv) == {"batch_1": b"one", "batch_2": b"two"}  # type: ignore[arg-type]


async def _no_workers(kv: KeyValue) -> object:
    return await workers_registry.read_all(kv)


@pytest.mark.parametrize("read", [snapshot, _no_workers], ids=["snapshot", "registry"])
async def test_a_read_leaves_no_consumer_behind(module_nats_url: str,
                                                read: Callable[[KeyValue], Any]) -> None:
    """Each read makes an ephemeral consumer; it must go once the read is
    done, or a tenant listing its files 1,000 times fills the bucket's
    consumer limit and every listing of every tenant fails (a 500). The
    workers' registry, read twice a second by the batch runner, had 370
    after 150 s of the soak (bench.soak)."""
    nc = await nats.connect(module_nats_url)
    try:
        js = nc.jetstream()
        kv = await js.create_key_value(bucket=f"reads{uuid.uuid4().hex[:8]}", history=1)
        await kv.put("a", b"1")
        for _ in range(20):
            await read(kv)
        stream = f"KV_{kv._name}"
        for _ in range(300):  # up to 60 s: the server reaps idle consumers on its own timer
            if not (await js.stream_info(stream)).state.consumer_count:
                break
            await asyncio.sleep(0.2)
        assert (await js.stream_info(stream)).state.consumer_count == 0
    finally:
        await nc.close()


class _Changes:
    """A watcher's replay, its "no more values" marker, live changes, its end."""

    def __init__(self, *changes: SimpleNamespace | None) -> None:
        self._changes = list(changes)

    def __aiter__(self) -> _Changes:
        return self

    async def __anext__(self) -> SimpleNamespace | None:
        if not self._changes:
            raise StopAsyncIteration
        return self._changes.pop(0)


def _change(key: str, revision: int, operation: str | None = None) -> SimpleNamespace:
    return SimpleNamespace(key=key, value=b"v", revision=revision, operation=operation)


async def test_a_follow_that_takes_no_deletes_remembers_no_key() -> None:
    """Cancel tombstones expire by their bucket's TTL, which tells a watcher
    nothing: a follow that remembered each live key grew for as long as the
    tier ran (the soak's worker). With a delete callback it must remember
    them, to report keys gone while it re-watched."""
    changes = (_change("a", 1), None, _change("b", 2), _change("c", 3))
    put: list[str] = []
    live = await _follow(None, _Changes(*changes), set(), lambda k, _: put.append(k),  # type: ignore[arg-type]
                         None, None, 0.5)
    assert (put, live) == (["a", "b", "c"], set())
    deleted: list[str] = []
    live = await _follow(None, _Changes(*changes, _change("b", 4, KV_DEL)),  # type: ignore[arg-type]
                         {"a", "gone"}, lambda k, _: None, deleted.append, None, 0.5)
    assert (live, deleted) == ({"a", "c"}, ["gone", "b"])
