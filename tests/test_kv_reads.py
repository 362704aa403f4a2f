"""One-off reads of a KV bucket that the CLI and the Files and Batches API
serve from: nats-py's ``kv.keys()`` decides it has seen every key from a
count the server may already have sent past, and a loaded machine then got
no keys at all (``tests/test_spend_cli.py`` in a full run). These reads go
through ``tidegate.broker.kvwatch.snapshot``, which takes what still arrives
after nats-py's "no more values" marker. The fake watcher hands out its
marker before every entry, as that race does."""

from __future__ import annotations

from tests.test_workers_registry_read import _KV, _Entry, _Watcher
from tidegate.control import batches
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
