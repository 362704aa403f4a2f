"""``previous_response_id`` is the tenant's own only (workers.owners): a worker
records who got each Responses API answer before its end goes out, and a job
naming another tenant's response, or one never given, gets 404
``previous_response_not_found`` before its backend is called."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest

from tests.pipeline import Pipeline, running_pipeline, tenant_keys
from tests.servers import ServerHandle
from tidegate import config as tgconfig
from tidegate.broker import broker
from tidegate.errors import BackendError
from tidegate.wire.protocol import Api, Request
from workers.owners import ResponseOwners, owner_key

pytestmark = pytest.mark.pipeline


def test_the_key_is_a_fixed_size_hash_of_any_id() -> None:
    assert owner_key("resp_1") == owner_key("resp_1") != owner_key("resp_2")
    for rid in ("resp_1", "x" * 100_000, "a.b*>c", "\udcff"):
        key = owner_key(rid)
        assert len(key) == 32
        assert set(key) <= set("0123456789abcdef")


def _request(api: Api, tenant: str, **body: Any) -> Request:
    return Request(id="r1", reply="tg.out.e.r1", model="m", api=api, stream=False,
                   body={"model": "m", **body}, created_ms=0, deadline_ms=0,
                   window_bytes=1024, window_msgs=8, tenant=tenant)


async def test_only_the_recorded_tenant_names_a_response(nats_server: ServerHandle) -> None:
    config = tgconfig.from_dict({"nats": {"url": nats_server.url}})
    nc = await broker.connect(config.nats, "owners-test")
    try:
        kv = await broker.ensure_owners_bucket(broker.jetstream(nc, config.nats), config)
        owners = ResponseOwners(kv, 5.0)
        await owners.record("resp_a", "tenant-a")
        await owners.check(_request(Api.RESPONSES, "tenant-a", previous_response_id="resp_a"))
        for tenant, rid in (("tenant-b", "resp_a"), ("tenant-a", "resp_never"),
                            ("tenant-a", "resp_a" + "x" * 1000)):
            with pytest.raises(BackendError) as exc:
                await owners.check(_request(Api.RESPONSES, tenant, previous_response_id=rid))
            assert (exc.value.status, exc.value.code, exc.value.param) == (
                404, "previous_response_not_found", "previous_response_id")
            assert len(exc.value.message) < 120, "a long id is not echoed whole"
        # Nothing named, or an API without stored responses: nothing checked.
        await owners.check(_request(Api.RESPONSES, "tenant-b", input="hi"))
        await owners.check(_request(Api.CHAT, "tenant-b", previous_response_id="resp_a"))
    finally:
        await nc.close()


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory: pytest.TempPathFactory, module_nats_url: str,
             module_redis_url: str) -> Iterator[Pipeline]:
    yield from running_pipeline(tmp_path_factory.mktemp("owners"), module_nats_url,
                                module_redis_url)


async def _post(session: aiohttp.ClientSession, pipeline: Pipeline, key: str,
                **body: Any) -> tuple[int, bytes]:
    async with session.post(f"{pipeline.base_url}/responses",
                            json={"model": "tidegate-sim", **body},
                            headers={"Authorization": f"Bearer {key}"}) as resp:
        return resp.status, await resp.read()


async def test_another_tenants_response_is_not_found(pipeline: Pipeline) -> None:
    key_a, key_b = await tenant_keys(pipeline, "tenant-a", "tenant-b")
    async with aiohttp.ClientSession() as session:
        status, raw = await _post(session, pipeline, key_a, input="first turn")
        assert status == 200, raw
        rid = json.loads(raw)["id"]
        # Streamed: the id from response.created, followed up the moment the
        # stream ends (the owner is recorded before the end goes out).
        status, raw = await _post(session, pipeline, key_a, input="streamed", stream=True)
        assert status == 200, raw
        streamed = json.loads(raw.split(b"data: ", 1)[1].split(b"\n", 1)[0])["response"]["id"]
        for given in (rid, streamed):
            status, raw = await _post(session, pipeline, key_a, input="next turn",
                                      previous_response_id=given)
            assert status == 200, raw
            assert json.loads(raw)["previous_response_id"] == given
            status, raw = await _post(session, pipeline, key_b, input="let me read that",
                                      previous_response_id=given)
            assert status == 404, raw
            error = json.loads(raw)["error"]
            assert error["code"] == "previous_response_not_found"
            assert error["type"] == "invalid_request_error"
        status, raw = await _post(session, pipeline, key_a, input="x",
                                  previous_response_id="resp_never_given")
        assert status == 404, raw


def test_only_workers_may_write_or_read_the_owners() -> None:
    """The owners are workers' alone: an edge (whose credentials may be
    stolen) could otherwise claim another tenant's response."""
    from tidegate.broker.permissions import access
    from tidegate.wire.subjects import Subjects

    s = Subjects("tg")
    grants = access(s)
    writes = f"$KV.{s.responses_bucket}.>"
    assert writes in grants["worker"].publish
    for role in ("edge", "dispatcher"):
        assert writes not in grants[role].publish
        assert not any(s.responses_bucket in a for a in grants[role].api)
