"""Redis Cluster: when ``redis.url`` names one, a cluster client instead of a plain one.

A cluster is ``redis+cluster://r1:6379,r2:6379`` (``rediss+cluster://`` for
TLS) or several comma-separated URLs. The seeds only start discovery; the
client follows the slot map. Every tidegate key carries one hash tag
(:mod:`dispatcher.quota`), so each script touches a single slot.

Outages are reported about as fast as on a single Redis (three retries within
70 ms, every socket operation bounded by ``timeout``); the client re-reads the
slot map once a primary is back. Docs: docs/quotas.md#redis-cluster.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeAlias
from urllib.parse import unquote, urlsplit

import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff

CLUSTER_SCHEMES = ("redis+cluster://", "rediss+cluster://")

# What a write on a pooled connection closed under it raises instead of a
# ConnectionError (uvloop: RuntimeError "handler is closed"; asyncio:
# AttributeError / TypeError on the cleared transport). redis-py issue 4287.
TRANSPORT_RACE: tuple[type[Exception], ...] = (RuntimeError, AttributeError, TypeError)

# What the quota store and queue mode accept: a single Redis or a cluster.
RedisClient: TypeAlias = aioredis.Redis | RedisCluster


def is_cluster_url(url: str) -> bool:
    """True when ``url`` names a Redis Cluster (see the module docstring)."""
    parts = [p for p in (s.strip() for s in url.split(",")) if p]
    return url.strip().startswith(CLUSTER_SCHEMES) or len(parts) > 1


def cluster_nodes(url: str) -> tuple[list[tuple[str, int]], dict[str, object]]:
    """The seed ``(host, port)`` list of a cluster URL and its client options.

    Options: ``ssl`` (``rediss``), ``username``/``password`` from the first
    part's userinfo. Raises ValueError for a seed without a port.
    """
    parts = [p for p in (s.strip() for s in url.split(",")) if p]
    first = parts[0]
    scheme = first.split("://", 1)[0] if "://" in first else "redis"
    nodes: list[tuple[str, int]] = []
    options: dict[str, object] = {}
    for i, part in enumerate(parts):
        split = urlsplit(part if "://" in part else f"{scheme}://{part}")
        if split.port is None or not split.hostname:
            raise ValueError(f"redis.url: {part!r} needs host:port")
        nodes.append((split.hostname, split.port))
        if i == 0:
            if split.username:
                options["username"] = unquote(split.username)
            if split.password:
                options["password"] = unquote(split.password)
    if scheme.startswith("rediss"):
        options["ssl"] = True
    return nodes, options


async def preload_scripts(client: RedisClient, scripts: Sequence[Any]) -> bool:
    """``SCRIPT LOAD`` every script (redis-py ``Script`` objects) before serving.

    A script's first call otherwise takes the ``NoScriptError`` path, which in
    redis-py 8.1's cluster client races with the other commands in flight and
    closes connections they are using (seen as "connection closed" errors on
    the first burst of each dispatcher). On a cluster the load goes to every
    primary. False when Redis did not answer (the first call then loads it).
    """
    try:
        for script in scripts:
            await client.script_load(script.script)
    except Exception:  # redis errors of every kind: serving must not depend on it
        return False
    return True


def connect_cluster(url: str, timeout: float) -> RedisCluster:
    """A cluster client with the quota store's settings (text replies, bounded calls)."""
    nodes, options = cluster_nodes(url)
    return RedisCluster(
        startup_nodes=[ClusterNode(host, port) for host, port in nodes],
        socket_timeout=timeout, socket_connect_timeout=timeout,
        # Three quick retries (10 ms, 20 ms, 40 ms): the cluster client closes
        # a node's pooled connections after one error, so a burst of commands
        # in flight fails together and must be able to reconnect; a primary
        # that is really down refuses at once, so the outage still shows in
        # well under ``timeout``.
        retry=Retry(ExponentialBackoff(cap=0.1, base=0.01), 3), decode_responses=True,
        # Per node; redis-py's cluster default is small and, when reached,
        # fails a command at once (MaxConnectionsError) instead of waiting. The
        # single-Redis pool is unbounded; match it closely enough.
        max_connections=1 << 16,
        **options)  # type: ignore[arg-type]
