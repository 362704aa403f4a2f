"""The desk (tidegate.control.desk, dispatcher/batch/desk.py) against a real nats-server.

Issue 44 row 7: edge credentials no longer write file and batch records, so
what the edge asks for is checked here the way an attacker holding those
credentials would ask: with a key of its own tenant (or none) and ids or
records that name another tenant's. Each test fails if the desk took the
tenant, the ids or the record from the edge instead of from the key.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import nats
import pytest
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from dispatcher.batch.desk import Desk as DeskService
from dispatcher.batch.keys import BatchKeys
from tidegate.broker import objects
from tidegate.config import Config
from tidegate.control import desk
from tidegate.control.batches import Stores, open_stores
from tidegate.control.keys import KeyRecord, key_digest
from tidegate.errors import ApiError, ProtocolError
from tidegate.wire.batch import BatchRecord, BatchStatus, new_batch_id, new_file_id

pytestmark = pytest.mark.pipeline

A_KEY, B_KEY, STATIC_KEY = "sk-tenant-a-0001", "sk-tenant-b-0002", "sk-static-0003"
A, B = f"Bearer {A_KEY}", f"Bearer {B_KEY}"


class Desks:
    """A desk service answering on the server, its stores, and an edge's client."""

    def __init__(self, nc: NATS, stores: Stores, keys: BatchKeys, client: desk.Desk,
                 service: DeskService) -> None:
        self.nc, self.stores, self.keys, self.client = nc, stores, keys, client
        self.service = service

    async def upload(self, auth: str, data: bytes = b'{"line": 1}\n') -> str:
        """An edge's upload: chunks published, then the desk asked to record them."""
        file_id = new_file_id()
        chunks = await objects.put_chunks(self.stores.js, self.stores.files_bucket, file_id,
                                          _one(data))
        await self.client.record_file(auth, file_id, "in.jsonl", "batch", chunks)
        return file_id

    async def content(self, file_id: str) -> bytes:
        return b"".join([c async for c in objects.read(self.stores.js,
                                                       self.stores.files_bucket, file_id)])


async def _one(data: bytes) -> AsyncIterator[bytes]:
    yield data


@pytest.fixture
async def desks(module_nats_url: str) -> AsyncIterator[Desks]:
    config = Config(auth=Config().auth.__class__(keys=(STATIC_KEY,)))
    nc = await nats.connect(module_nats_url)
    stores = await open_stores(nc.jetstream(), config)
    keys = BatchKeys(config)
    for key, tenant in ((A_KEY, "tenant-a"), (B_KEY, "tenant-b")):
        digest = key_digest(key)
        keys.on_put(digest, KeyRecord(key_id=digest[:12], tenant=tenant, user=f"u-{tenant}"))
    keys.on_synced()
    service = DeskService(config, nc, stores, keys)
    sub = await nc.subscribe(config.nats.subjects.desk, queue="desk", cb=service.on_message)
    try:
        yield Desks(nc, stores, keys, desk.Desk(nc, config.nats.subjects), service)
    finally:
        await sub.unsubscribe()
        await nc.close()


async def test_a_file_is_its_keys_tenants_and_no_other_key_deletes_or_discards_it(
        desks: Desks) -> None:
    file_id = await desks.upload(B)
    record = await desks.stores.get_file("tenant-b", file_id)
    assert record is not None
    assert record.tenant == "tenant-b"
    with pytest.raises(ApiError) as caught:
        await desks.client.delete_file(A, file_id)
    assert caught.value.status == 404
    await desks.client.discard(A, file_id)  # answered, and leaves another tenant's file be
    assert await desks.stores.get_file("tenant-b", file_id) == record
    assert await desks.content(file_id) == b'{"line": 1}\n'
    await desks.client.delete_file(B, file_id)
    assert await desks.stores.get_file("tenant-b", file_id) is None
    assert not await objects.exists(desks.stores.js, desks.stores.files_bucket, file_id)


async def test_sealing_over_a_taken_id_is_refused(desks: Desks) -> None:
    """Chunks recorded under another tenant's file id would replace its content."""
    file_id = await desks.upload(B)
    forged = await objects.put_chunks(desks.stores.js, desks.stores.files_bucket, file_id,
                                      _one(b"forged"))
    with pytest.raises(ApiError) as caught:
        await desks.client.record_file(A, file_id, "x", "batch", forged)
    assert (caught.value.status, caught.value.code) == (502, "protocol_error")
    assert await desks.content(file_id) == b'{"line": 1}\n'
    record = await desks.stores.get_file("tenant-b", file_id)
    assert record is not None
    assert record.tenant == "tenant-b"


async def test_a_batch_is_its_keys_with_output_files_of_its_own(desks: Desks) -> None:
    b_file = await desks.upload(B)
    a_file = await desks.upload(A)
    now = int(time.time())
    # Everything an edge could forge: the tenant, the key, the state, and
    # output ids naming tenant B's file (the runner would overwrite it).
    forged = BatchRecord(id=new_batch_id(), tenant="tenant-b", key_id="b" * 12, user="ub",
                         endpoint="/v1/chat/completions", input_file_id=a_file,
                         completion_window="24h", created_at=now, expires_at=now + 10**9,
                         output_file_id=b_file, error_file_id=b_file,
                         status=BatchStatus.COMPLETED, files_written=True)
    made = await desks.client.create_batch(A, forged)
    stored = await desks.stores.get_batch(None, forged.id)
    assert stored == made
    assert (made.tenant, made.key_id, made.user) == ("tenant-a", key_digest(A_KEY)[:12],
                                                     "u-tenant-a")
    assert made.status is BatchStatus.VALIDATING
    assert not made.files_written
    assert b_file not in (made.output_file_id, made.error_file_id)
    assert made.expires_at - made.created_at <= int(Config().batch.max_window)
    # Another tenant's file as the input reads as missing.
    with pytest.raises(ApiError) as caught:
        await desks.client.create_batch(A, BatchRecord(
            id=new_batch_id(), tenant="tenant-a", endpoint="/v1/chat/completions",
            input_file_id=b_file, completion_window="24h", created_at=now,
            expires_at=now + 60, output_file_id=new_file_id(), error_file_id=new_file_id()))
    assert caught.value.status == 404
    # Only its tenant cancels it.
    with pytest.raises(ApiError) as caught:
        await desks.client.cancel_batch(B, made.id)
    assert caught.value.status == 404
    cancelled = await desks.client.cancel_batch(A, made.id)
    assert cancelled.status is BatchStatus.CANCELLING


async def test_unknown_revoked_and_expired_keys_get_401_and_config_keys_are_tenant_default(
        desks: Desks) -> None:
    for auth in ("Bearer sk-nobody", "Basic " + A_KEY, "", "Bearer "):
        with pytest.raises(ApiError) as caught:
            await desks.upload(auth)
        assert (caught.value.status, caught.value.code) == (401, "invalid_api_key")
    digest = key_digest(A_KEY)
    desks.keys.on_put(digest, KeyRecord(key_id=digest[:12], tenant="tenant-a", expires=1.0))
    with pytest.raises(ApiError) as caught:
        await desks.upload(A)
    assert caught.value.code == "expired_api_key"
    desks.keys.on_delete(digest)
    with pytest.raises(ApiError) as caught:
        await desks.upload(A)
    assert caught.value.code == "invalid_api_key"
    file_id = await desks.upload(f"Bearer {STATIC_KEY}")
    assert await desks.stores.get_file("default", file_id) is not None


async def test_a_discard_removes_an_unrecorded_uploads_chunks(desks: Desks) -> None:
    file_id = new_file_id()
    await objects.put_chunks(desks.stores.js, desks.stores.files_bucket, file_id,
                             _one(b"x" * 1000))
    stream = f"OBJ_{desks.stores.files_bucket}"
    subject = f"$O.{desks.stores.files_bucket}.C.{file_id}"

    async def chunks_kept() -> int:
        info = await desks.stores.js.stream_info(stream, subjects_filter=subject)
        return sum((info.state.subjects or {}).values())

    assert await chunks_kept() == 1
    await desks.client.discard(A, file_id)
    assert await chunks_kept() == 0


async def test_a_desk_that_is_reading_the_keys_answers_once_it_has_read_them(
        desks: Desks) -> None:
    """A dispatcher answers the desk as it starts: an upload made before its
    first read of the keys waits for that read (CI at 0749c7f: a 503)."""
    desks.keys.synced.clear()
    upload = asyncio.create_task(desks.upload(A))
    await asyncio.sleep(0.3)
    desks.keys.on_synced()
    file_id = await upload
    assert (await desks.stores.get_file("tenant-a", file_id)) is not None


async def test_a_desk_that_has_not_read_the_keys_or_is_gone_asks_for_a_retry(
        desks: Desks) -> None:
    desks.keys.synced.clear()
    desks.service.keys_wait = 0.05
    with pytest.raises(ApiError) as caught:
        await desks.upload(A)
    assert (caught.value.status, caught.value.retryable) == (503, True)
    desks.keys.on_synced()
    alone = desk.Desk(desks.nc, Config().nats.subjects.__class__(prefix="nobodyhere"))
    with pytest.raises(ApiError) as caught:
        await alone.delete_file(A, new_file_id())
    assert (caught.value.status, caught.value.code) == (503, "dispatcher_unavailable")


async def test_an_ask_made_before_any_dispatcher_listens_is_answered_once_one_does(
        desks: Desks) -> None:
    """No dispatcher's desk yet (one starting: "no responders", nobody took
    the ask): the edge asks again until one answers, within its wait (CI at
    61feaee: an upload right after the start got 503 at once)."""
    subjects = Config().nats.subjects.__class__(prefix="latedesk")
    file_id = new_file_id()
    asked = asyncio.create_task(desk.Desk(desks.nc, subjects).delete_file(A, file_id))
    await asyncio.sleep(1.0)  # asked, and refused for "no responders", a few times
    assert not asked.done()
    answered: list[bytes] = []

    async def late_desk(msg: Msg) -> None:
        answered.append(msg.data)
        await msg.respond(desk.refusal(ApiError(404, "no such file", type="invalid_request_error",
                                                code="not_found")))

    sub = await desks.nc.subscribe(subjects.desk, queue="desk", cb=late_desk)
    try:
        with pytest.raises(ApiError) as caught:
            await asked
    finally:
        await sub.unsubscribe()
    assert (caught.value.status, len(answered)) == (404, 1)


def test_asks_round_trip_and_garbage_is_refused() -> None:
    chunks = objects.Chunks("file-" + "1" * 32, 5, 1, "SHA-256=x")
    ask = desk.Ask(desk.FILE, A, chunks.nuid, "f.jsonl", "batch", chunks)
    assert desk.Ask.decode(ask.encode()) == ask
    for garbage in (b"", b"\x81\xa2op\xa4file", desk.Ask("erase", A).encode(),
                    ask.encode().replace(b"batch", b"\xc0\xc0\xc0\xc0\xc0")):
        with pytest.raises(ProtocolError):
            desk.Ask.decode(garbage)
    refused = desk.refusal(ApiError(409, "taken", type="invalid_request_error", code="conflict"))
    with pytest.raises(ApiError) as caught:
        desk.read_answer(refused)
    assert (caught.value.status, caught.value.code, caught.value.message) == (409, "conflict",
                                                                              "taken")
    assert desk.read_answer(desk.answer(b"rec")) == b"rec"
    with pytest.raises(ApiError) as caught:
        desk.read_answer(b"\x00")
    assert caught.value.status == 502


async def test_a_malformed_ask_gets_no_answer_and_the_desk_keeps_serving(desks: Desks) -> None:
    inbox = desks.nc.new_inbox()
    sub = await desks.nc.subscribe(inbox)
    await desks.nc.publish(Config().nats.subjects.desk, b"\xff garbage", reply=inbox)
    # Answered after the garbage (one connection, one subscription: in
    # order), so an answer to the garbage would have arrived before it.
    await desks.upload(A)
    assert sub.pending_msgs == 0
    await sub.unsubscribe()


async def test_a_request_the_desk_fails_on_is_answered_500_not_left_to_time_out(
        desks: Desks, monkeypatch: pytest.MonkeyPatch) -> None:
    async def broken(tenant: str, file_id: str) -> None:
        raise RuntimeError("a record nobody foresaw")

    monkeypatch.setattr(desks.stores, "get_file", broken)
    with pytest.raises(ApiError) as caught:
        await desks.client.delete_file(A, new_file_id())
    assert (caught.value.status, caught.value.code) == (500, "internal_error")
