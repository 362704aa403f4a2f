"""Quotas on a real Redis Cluster (3 primaries, slots assigned by the fixture).

Proves docs/quotas.md's hash-tag claim: every script the dispatcher runs
touches one slot, so the exact-TPM test of three dispatchers passes unchanged
on a cluster; and a primary killed mid-burst gives the configured
fail-closed / fail-open answer, then recovers when it is back.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from dispatcher.quota import Limits, QuotaStore, Scope, connect
from dispatcher.redis_client import cluster_nodes, is_cluster_url
from fleet.run.clusters import RedisCluster
from tests import test_quotas_pipeline as quotas
from tidegate import config as tgconfig
from tidegate.control.policies import Policy
from tidegate.errors import ConfigError

# --------------------------------------------------------------------------
# URL parsing: no servers
# --------------------------------------------------------------------------


def test_cluster_urls_are_recognised() -> None:
    assert is_cluster_url("redis+cluster://a:1,b:2")
    assert is_cluster_url("redis+cluster://a:1")
    assert is_cluster_url("redis://a:1/0,redis://b:2/0")
    assert not is_cluster_url("redis://a:6379/0")
    assert not is_cluster_url("rediss://user:pw@a:6379/0")
    nodes, options = cluster_nodes("rediss+cluster://u:p%40ss@a:1,b:2, c:3")
    assert nodes == [("a", 1), ("b", 2), ("c", 3)]
    assert options == {"username": "u", "password": "p@ss", "ssl": True}
    assert cluster_nodes("redis://a:1/0,redis://b:2/0") == ([("a", 1), ("b", 2)], {})
    with pytest.raises(ValueError, match="host:port"):
        cluster_nodes("redis+cluster://a,b:2")


def test_config_accepts_cluster_urls() -> None:
    cfg = tgconfig.load(None, {"TIDEGATE_REDIS_URL": "redis+cluster://a:1,b:2"}, {})
    assert cfg.redis.url == "redis+cluster://a:1,b:2"
    with pytest.raises(ConfigError, match=r"redis\.url"):
        tgconfig.load(None, {"TIDEGATE_REDIS_URL": "http://a:1"}, {})


# --------------------------------------------------------------------------
# Real cluster
# --------------------------------------------------------------------------

pipeline = pytest.mark.pipeline


@pipeline
async def test_quota_scripts_run_on_the_cluster_in_one_slot(redis_cluster: RedisCluster) -> None:
    client = connect(redis_cluster.url, timeout=2.0)
    try:
        store = QuotaStore(client, prefix="tg", window=60.0)
        scopes = [Scope(f"t:{i}", Limits(rpm=2, tpm=1000, concurrency=5)) for i in range(4)]
        first = await store.reserve("r1", scopes, 100)
        second = await store.reserve("r2", scopes, 100)
        third = await store.reserve("r3", scopes, 100)
        assert (first.admitted, second.admitted, third.admitted) == (True, True, False)
        assert third.limit == "requests"
        await store.reconcile("r1", 10)
        await store.release("r2")
        # Every key went to the one primary owning the hash tag's slot.
        owner = redis_cluster.owner(store.key_prefix + "x")
        for node in redis_cluster.nodes:
            keys = _keys(node.port)
            assert bool(keys) == (node is owner), (node.name, keys)
            assert all(k.startswith(store.key_prefix) for k in keys)
    finally:
        await client.aclose()


def _keys(port: int) -> list[str]:
    import redis

    with redis.Redis(port=port, decode_responses=True) as r:
        return [str(k) for k in r.keys("*")]


@pipeline
async def test_tpm_limit_is_exact_across_three_dispatchers_on_a_cluster(
        tmp_path: Path, module_nats_url: str, redis_cluster: RedisCluster) -> None:
    # The single-Redis test, unchanged, against the cluster URL.
    await quotas.test_tpm_limit_is_exact_across_three_dispatchers(
        tmp_path, module_nats_url, redis_cluster.url)


async def _burst_with_a_primary_killed(tmp_path: Path, nats_url: str, cluster: RedisCluster,
                                       failure: str) -> tuple[list[int], list[Any], float]:
    """Streams of requests while the quota slot's primary is SIGKILLed, then restarted.

    Returns the statuses and error bodies seen while it was down, and how long
    after the restart requests were admitted again.
    """
    p, key = await quotas.start_provisioned(tmp_path, nats_url, cluster.url, "t",
                                            [Policy(tenant="t", rpm=100_000)],
                                            dispatcher={"quota_failure": failure})
    try:
        prefix = p.config.nats.subject_prefix
        owner = cluster.owner(f"{prefix}:{{{prefix}q}}:x")
        async with aiohttp.ClientSession() as session:
            await quotas.until_status(session, p, key, 200, within=10)
            stop = asyncio.Event()

            async def load() -> list[tuple[int, Any]]:
                seen = []
                while not stop.is_set():
                    status, _, body = await quotas.chat(session, p, key, max_tokens=2)
                    seen.append((status, body))
                return seen

            tasks = [asyncio.create_task(load()) for _ in range(4)]
            await asyncio.sleep(0.3)  # mid-burst
            owner.kill()
            down = time.monotonic()
            await asyncio.sleep(1.5)
            during = len([t for t in tasks if not t.done()])
            assert during == 4, "load tasks ended early"
            stop.set()
            results = [r for t in tasks for r in await t]
            assert time.monotonic() - down < 30, "requests hung while the primary was down"
            await asyncio.to_thread(owner.restart)
            await asyncio.to_thread(cluster.wait_ok, 30.0)
            took = await quotas.until_status(session, p, key, 200, within=20)
    finally:
        p.stop()
    return [s for s, _ in results], [b for _, b in results], took


@pipeline
async def test_cluster_primary_killed_mid_burst_fails_closed_then_recovers(
        tmp_path: Path, module_nats_url: str, redis_cluster: RedisCluster) -> None:
    statuses, bodies, took = await _burst_with_a_primary_killed(
        tmp_path, module_nats_url, redis_cluster, "closed")
    assert set(statuses) <= {200, 503}, statuses
    refused = [b for s, b in zip(statuses, bodies, strict=True) if s == 503]
    assert refused, f"no request was refused while the quota primary was down: {statuses}"
    assert {b["error"]["code"] for b in refused} == {"quota_store_unavailable"}
    print(f"fail-closed: {statuses.count(200)} admitted before the kill, {len(refused)} "
          f"refused while down; admitted again {took:.2f}s after the restart")


@pipeline
async def test_cluster_primary_killed_mid_burst_fails_open_then_recovers(
        tmp_path: Path, module_nats_url: str, redis_cluster: RedisCluster) -> None:
    statuses, bodies, took = await _burst_with_a_primary_killed(
        tmp_path, module_nats_url, redis_cluster, "open")
    assert set(statuses) == {200}, [b for b in bodies if "error" in b][:3]
    print(f"fail-open: {len(statuses)} requests admitted through the outage; "
          f"metered again {took:.2f}s after the restart")
