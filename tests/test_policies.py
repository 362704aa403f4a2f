"""Quota policies (tidegate.policies): scopes, the PolicySet index, and the KV bucket."""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from nats.js.kv import KeyValue

from tests.servers import ServerHandle
from tidegate import config as tgconfig
from tidegate.broker import broker
from tidegate.control.policies import (
    Policy,
    PolicySet,
    delete_policy,
    ensure_policies_bucket,
    list_policies,
    parse_scope_id,
    scope_id,
    set_policy,
    watch_policies,
)
from tidegate.errors import ProtocolError

KV_KEY = re.compile(r"[-/_=.a-zA-Z0-9]+")

# Free-form names, including the characters that matter: ".", "=", "_", "*",
# spaces, non-ASCII.
names = st.text(alphabet=st.sampled_from("ab-_.=*/ é"), min_size=1, max_size=6)
maybe = st.one_of(st.just(""), names)


@st.composite
def scopes(draw: st.DrawFn) -> tuple[str, str, str]:
    tenant, model, user = draw(maybe), draw(maybe), draw(maybe)
    if not tenant:
        user = ""
        if not model:
            model = draw(names)
    return tenant, model, user


@st.composite
def policies(draw: st.DrawFn) -> Policy:
    tenant, model, user = draw(scopes())
    limit = st.integers(min_value=0, max_value=10**9)
    return Policy(tenant=tenant, model=model, user=user, rpm=draw(limit), tpm=draw(limit),
                  concurrency=draw(limit))


# --------------------------------------------------------------------------
# Scope ids
# --------------------------------------------------------------------------


def test_scope_id_examples() -> None:
    assert scope_id("acme") == "tenant.acme.model.=.user.="
    assert scope_id(model="gpt-4o") == "tenant.=.model.gpt-4o.user.="
    assert scope_id("acme", "meta/llama-3.1") == (
        "tenant.acme.model.meta_2Fllama-3_2E1.user.=")
    assert scope_id("acme", user="alice") == "tenant.acme.model.=.user.alice"
    assert Policy(tenant="acme", tpm=5).scope_id == scope_id("acme")


@given(scopes())
def test_scope_id_is_a_valid_kv_key_and_round_trips(scope: tuple[str, str, str]) -> None:
    sid = scope_id(*scope)
    assert KV_KEY.fullmatch(sid)
    assert not sid.startswith(".")
    assert not sid.endswith(".")
    assert parse_scope_id(sid) == scope


@given(scopes(), scopes())
def test_distinct_scopes_have_distinct_ids(a: tuple[str, str, str],
                                           b: tuple[str, str, str]) -> None:
    assert (scope_id(*a) == scope_id(*b)) == (a == b)


@pytest.mark.parametrize("sid", [
    "", "tenant.a", "tenant.a.model.b.user", "tenant.a.model.b.user.c.extra",
    "model.a.tenant.b.user.=", "tenant.=.model.=.user.=",  # global: not a scope
    "tenant.=.model.m.user.u",  # user without tenant
    "tenant.a_4.model.=.user.=",  # malformed escape
    "tenant..model.=.user.=",
])
def test_parse_rejects_non_scope_ids(sid: str) -> None:
    with pytest.raises(ValueError, match=r"scope id|tenant|token"):
        parse_scope_id(sid)


# --------------------------------------------------------------------------
# Policy
# --------------------------------------------------------------------------


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"user": "alice", "rpm": 1}, "needs its tenant"),
    ({"model": "m", "user": "alice", "rpm": 1}, "needs its tenant"),
    ({"rpm": 1}, "tenant, a model or both"),
    ({"tenant": "a", "rpm": -1}, "rpm must be an integer >= 0"),
    ({"tenant": "a", "tpm": 1.5}, "tpm must be an integer"),
    ({"tenant": "a", "concurrency": True}, "concurrency must be an integer"),
    ({"tenant": 3, "rpm": 1}, "tenant must be a string"),
])
def test_invalid_policies(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Policy(**kwargs)


@given(policies())
def test_policy_round_trips(policy: Policy) -> None:
    assert Policy.decode(policy.encode()) == policy
    assert json.loads(policy.encode()) == policy.as_dict()


@pytest.mark.parametrize("data", [
    b"", b"[]", b'"x"', b'{"tenant": "a", "rpm": -1}', b'{"tenant": "a", "rps": 1}',
    b'{"user": "u", "rpm": 1}', b'{"rpm": 1}', b'{"tenant": "a", "tpm": "1"}',
])
def test_malformed_policy_is_a_protocol_error(data: bytes) -> None:
    with pytest.raises(ProtocolError):
        Policy.decode(data)


def test_scope_label_and_limits() -> None:
    assert Policy(tenant="acme", model="m").scope_label == "tenant 'acme' x model 'm'"
    assert Policy(tenant="acme", user="u").scope_label == "tenant 'acme' x user 'u'"
    assert not Policy(tenant="acme").has_limits
    assert Policy(tenant="acme", concurrency=1).has_limits


# --------------------------------------------------------------------------
# PolicySet
# --------------------------------------------------------------------------


def test_applicable_per_scope() -> None:
    tenant = Policy(tenant="acme", tpm=100_000)
    model = Policy(model="gpt", rpm=1000)
    tenant_model = Policy(tenant="acme", model="gpt", rpm=60)
    user = Policy(tenant="acme", user="alice", concurrency=2)
    other = Policy(tenant="beta", tpm=5)
    ps = PolicySet([tenant, model, tenant_model, user, other])
    assert len(ps) == 5
    assert ps.applicable("acme", "gpt", "alice") == [user, tenant_model, tenant, model]
    assert ps.applicable("acme", "gpt", "bob") == [tenant_model, tenant, model]
    assert ps.applicable("acme", "gpt") == [tenant_model, tenant, model]
    assert ps.applicable("acme", "llama", "alice") == [user, tenant]
    assert ps.applicable("beta", "gpt", "alice") == [other, model]
    assert ps.applicable("gamma", "llama", "alice") == []
    # alice of another tenant is another user
    assert user not in ps.applicable("beta", "llama", "alice")


def test_put_replaces_and_remove_deletes() -> None:
    ps = PolicySet()
    ps.put(Policy(tenant="acme", rpm=1))
    ps.put(Policy(tenant="acme", rpm=2))
    assert len(ps) == 1
    assert ps.applicable("acme", "m") == [Policy(tenant="acme", rpm=2)]
    assert ps.get("acme") == Policy(tenant="acme", rpm=2)
    assert ps.remove(scope_id("beta")) is None
    assert ps.remove("not a scope id") is None
    assert ps.remove(scope_id("acme")) == Policy(tenant="acme", rpm=2)
    assert len(ps) == 0
    assert ps.applicable("acme", "m") == []


class CountingDict(dict[Any, Any]):
    lookups = 0

    def get(self, key: Any, default: Any = None) -> Any:
        type(self).lookups += 1
        return super().get(key, default)


def matches(policy: Policy, tenant: str, model: str, user: str) -> bool:
    return all(not want or want == have for want, have in
               ((policy.tenant, tenant), (policy.model, model), (policy.user, user)))


@given(st.lists(policies(), max_size=30), st.lists(st.tuples(names, names, maybe),
                                                  min_size=1, max_size=10))
def test_applicable_equals_a_full_scan_with_few_lookups(
        stored: list[Policy], requests: list[tuple[str, str, str]]) -> None:
    ps = PolicySet(stored)
    expected_set = {p.scope: p for p in stored}  # the last put per scope wins
    assert len(ps) == len(expected_set)
    ps._by_scope = CountingDict(ps._by_scope)
    for tenant, model, user in requests:
        CountingDict.lookups = 0
        got = ps.applicable(tenant, model, user)
        assert CountingDict.lookups <= 8
        expected = [p for p in expected_set.values() if matches(p, tenant, model, user)]
        assert sorted(got, key=lambda p: p.scope) == sorted(expected, key=lambda p: p.scope)
        assert len({p.scope for p in got}) == len(got)
        # narrowest first: a policy never follows one with strictly more fields set
        widths = [sum(map(bool, p.scope)) for p in got]
        assert widths == sorted(widths, reverse=True)


@given(st.lists(policies(), max_size=20), st.data())
def test_remove_by_scope_id_after_puts(stored: list[Policy], data: st.DataObject) -> None:
    ps = PolicySet(stored)
    for policy in data.draw(st.permutations(stored)):
        ps.remove(policy.scope_id)
        assert policy.scope not in {p.scope for p in ps}
    assert len(ps) == 0


# --------------------------------------------------------------------------
# Against nats-server
# --------------------------------------------------------------------------


@pytest.fixture
async def kv(nats_server: ServerHandle) -> AsyncIterator[KeyValue]:
    config = tgconfig.from_dict({"nats": {"url": nats_server.url}})
    nc = await broker.connect(config.nats, "test-policies")
    try:
        yield await ensure_policies_bucket(broker.jetstream(nc, config.nats), config)
    finally:
        await nc.close()


async def eventually(check: Callable[[], bool], within: float) -> None:
    start = time.monotonic()
    while not check():
        if time.monotonic() - start > within:
            pytest.fail(f"condition not met within {within}s")
        await asyncio.sleep(0.01)


async def test_set_list_delete_round_trip(kv: KeyValue) -> None:
    assert await list_policies(kv) == []
    a = Policy(tenant="acme", tpm=1000)
    b = Policy(tenant="acme", model="meta/llama-3.1", rpm=60)
    c = Policy(model="gpt", concurrency=4)
    for policy in (a, b, c):
        await set_policy(kv, policy)
    assert (await kv.get(b.scope_id)).value == b.encode()
    assert await list_policies(kv) == [c, a, b]
    a2 = Policy(tenant="acme", rpm=5)  # replaces, does not merge
    await set_policy(kv, a2)
    assert await list_policies(kv) == [c, a2, b]
    assert await delete_policy(kv, a.scope_id) is True
    assert await delete_policy(kv, a.scope_id) is False
    assert await delete_policy(kv, scope_id("nobody")) is False
    assert await list_policies(kv) == [c, b]


async def test_set_needs_a_limit(kv: KeyValue) -> None:
    with pytest.raises(ValueError, match="at least one limit"):
        await set_policy(kv, Policy(tenant="acme"))


async def test_watch_keeps_a_policy_set_in_step_within_a_second(kv: KeyValue) -> None:
    existing = Policy(tenant="acme", tpm=1000)
    await set_policy(kv, existing)
    await set_policy(kv, Policy(tenant="gone", rpm=1))
    await delete_policy(kv, scope_id("gone"))
    ps = PolicySet()
    synced = asyncio.Event()
    task = asyncio.create_task(watch_policies(kv, ps, on_synced=synced.set))
    try:
        await asyncio.wait_for(synced.wait(), 5)
        assert list(ps) == [existing]
        changed = Policy(tenant="acme", tpm=10)
        await set_policy(kv, changed)
        await eventually(lambda: ps.get("acme") == changed, 15.0)
        per_model = Policy(tenant="acme", model="m", rpm=3)
        await set_policy(kv, per_model)
        await eventually(lambda: ps.applicable("acme", "m") == [per_model, changed], 15.0)
        await delete_policy(kv, changed.scope_id)
        await eventually(lambda: ps.applicable("acme", "m") == [per_model], 15.0)
        # A value under the wrong scope id, or garbage, changes nothing.
        await kv.put(scope_id("acme"), Policy(tenant="beta", rpm=1).encode())
        await kv.put(per_model.scope_id, b"garbage")
        await set_policy(kv, Policy(tenant="marker", rpm=1))
        await eventually(lambda: ps.get("marker") is not None, 15.0)
        assert list(ps) == [per_model, Policy(tenant="marker", rpm=1)]
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
