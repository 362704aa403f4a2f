"""Quota enforcement in Redis: one Lua script, one round trip per admission.

A request is charged against every :class:`Scope` whose policy applies to it
(tenant, model, user, tenant x model). :meth:`QuotaStore.reserve` checks and
records the reservation in all of them at once, atomically: either every scope
has room and every scope is charged, or nothing is written.

Algorithm: an exact sliding window
----------------------------------

Per scope that limits requests or tokens:

* ``w`` - sorted set, member = request id, score = reservation time;
* ``a`` - hash, request id -> tokens charged;
* ``t`` - the running token total of the entries in ``w``.

Every call first evicts the entries older than ``window`` (subtracting their
amounts from the total), then checks ``count + 1 <= rpm`` and ``total + cost
<= tpm``. The window is exact: at no instant do the reservations made in the
trailing ``window`` seconds exceed a limit (no fixed-window boundary burst, no
approximation as in the two-counter sliding window). Memory is one zset entry
and one hash field (under 100 bytes) per admitted request per scope, kept for
one window.

Per scope that limits concurrency, ``c`` is a sorted set of request ids scored
by lease expiry (``now + lease``). Expired leases are evicted on every call:
that is how a slot held by a dead dispatcher or worker comes back without
anyone releasing it. ``lease`` must therefore be at least the longest a
request may run (``edge.request_timeout``).

Each reservation is also written to a record ``r`` (scopes, amount, time,
whether it holds a slot) with a TTL beyond both window and lease, so
:meth:`QuotaStore.reconcile` and :meth:`QuotaStore.release` can find what to
adjust from the request id alone. Both are idempotent: the first reconcile
deletes the record, the first release clears its slot flag. Reserving an id
that is already charged (a request redelivered to another dispatcher) admits
it without charging it again.

Accuracy. Against the reserved amounts the window is exact, across any number
of dispatchers, because one script decides and Redis runs scripts one at a
time. Usage can exceed a limit only through reconciliation upwards: a request
whose actual tokens exceed its reservation (the prompt estimate was low; the
completion is capped by ``max_tokens``, which is reserved in full). The
overshoot is then charged to the window, so later requests wait for it.
Reconciliation downwards frees the unused part of a reservation at once.

Time. ``now`` comes from the caller (``time.time()`` by default) and is
passed to the script. Redis's own clock is not used so tests can drive a fake
clock; the cost is that dispatchers must agree on the time. With NTP-synced
hosts (skew of milliseconds) the error is that skew out of a 60 s window. A
dispatcher whose clock is ``d`` seconds behind evicts entries ``d`` seconds
late (stricter); ``d`` ahead, early (laxer by what was reserved in those ``d``
seconds).

Redis Cluster
-------------

Every key carries the same hash tag, ``<prefix>:{<prefix>q}:...``, so all
quota keys live in one slot and one script may touch them. A per-tenant tag
would not do: one request's scopes span tenant-wide and model-wide limits (the
model scope is shared by every tenant), and no tagging scheme co-locates every
tenant's keys with every model's keys except a single tag. The cost is that
all quota state lives on one shard (one primary plus its replicas). That is
ample: a reserve costs Redis about 20-25 us for one scope and 45-65 us for
four (Redis 6.2 on a 2-core VM), so one shard runs roughly 15,000 to 50,000
admissions per second. Every key a script touches is passed in ``KEYS``, as
Cluster requires. Reconcile and release first read the
record to learn the scopes (one extra read), then run their script with those
keys declared.

Errors: Redis unreachable or timing out raises :class:`QuotaUnavailable`; the
admission policy fails open or closed. Use :func:`connect` (or equivalent
client settings) so an outage is reported within ``timeout``, not after the
client's own retries and backoff.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol, cast

import redis.asyncio as aioredis
import redis.exceptions as rexc
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from dispatcher.cluster import TRANSPORT_RACE, RedisClient, connect_cluster, is_cluster_url
from tidegate.errors import TidegateError

__all__ = [
    "Limits",
    "QuotaResult",
    "QuotaStore",
    "QuotaUnavailable",
    "Quotas",
    "Scope",
    "connect",
]

LimitKind = Literal["", "requests", "tokens", "concurrency"]

# Keys outlive their data by this much (seconds of Redis time). Scores use the
# caller's clock; the margin absorbs clock skew between dispatchers and Redis.
_TTL_MARGIN = 60.0

# A refused concurrency slot frees when some stream ends, which nobody can
# predict; clients are told to try again after this many seconds.
_CONCURRENCY_RETRY = 1.0


class QuotaUnavailable(TidegateError):
    """Redis could not be reached or did not answer in time."""


@dataclass(frozen=True, slots=True)
class Limits:
    """Per-scope limits; 0 means unlimited."""

    rpm: int = 0  # requests per window
    tpm: int = 0  # tokens per window
    concurrency: int = 0  # requests holding a slot at once


@dataclass(frozen=True, slots=True)
class Scope:
    """One policy a request is charged against. ``id`` names the policy stably
    (e.g. ``tenant.acme.model.=.user.=``): it is part of the Redis keys."""

    id: str
    limits: Limits


@dataclass(frozen=True, slots=True)
class QuotaResult:
    """The outcome of :meth:`QuotaStore.reserve`.

    When refused, ``limit`` and ``scope`` name the limit that refused (the one
    that frees last when several do) and ``retry_after`` is when the request
    would fit, all else unchanged. ``too_large`` means the reservation exceeds
    a token limit by itself: it can never pass.

    The ``*_requests`` / ``*_tokens`` fields are OpenAI's rate-limit header
    values for the most constraining scope (least remaining) of each kind, or
    0 when no scope limits that kind. ``reset_*`` is the time (seconds) until
    that scope's window is back to its initial state, i.e. holds none of its
    current entries.
    """

    admitted: bool
    limit: LimitKind = ""
    scope: str = ""
    retry_after: float = 0.0
    too_large: bool = False
    limit_requests: int = 0
    remaining_requests: int = 0
    reset_requests: float = 0.0
    limit_tokens: int = 0
    remaining_tokens: int = 0
    reset_tokens: float = 0.0


class Quotas(Protocol):
    """The seam the admission policy depends on (a fake implements it in tests)."""

    async def reserve(self, request_id: str, scopes: Sequence[Scope], tokens: int,
                      now: float | None = None) -> QuotaResult: ...

    async def reconcile(self, request_id: str, actual_tokens: int,
                        now: float | None = None) -> None: ...

    async def release(self, request_id: str) -> None: ...


def connect(url: str, timeout: float) -> RedisClient:
    """A client suited to the store: replies as text, every socket operation
    bounded by ``timeout``, and one immediate retry (a pooled connection broken
    by a Redis restart fails once, its replacement then connects) instead of
    redis-py's default backoff, which would delay reporting an outage by
    seconds. A cluster URL (:mod:`dispatcher.cluster`) gets a cluster client."""
    if is_cluster_url(url):
        return connect_cluster(url, timeout)
    return aioredis.Redis.from_url(
        url, socket_timeout=timeout, socket_connect_timeout=timeout,
        retry=Retry(NoBackoff(), 1), decode_responses=True)


# --------------------------------------------------------------------------
# Scripts
# --------------------------------------------------------------------------

# Shared helpers. A window's keys are w (zset id->time), a (hash id->tokens),
# t (token total); c is the concurrency lease zset (id->expiry).
_LUA_COMMON = """
local function evict(w, a, t, cutoff)
  local old = redis.call('ZRANGEBYSCORE', w, '-inf', cutoff)
  if #old == 0 then return end
  local freed = 0
  -- bounded unpack(): Lua's stack holds a few thousand values at most
  for i = 1, #old, 1000 do
    local chunk = {unpack(old, i, math.min(i + 999, #old))}
    local amounts = redis.call('HMGET', a, unpack(chunk))
    for j = 1, #amounts do freed = freed + (tonumber(amounts[j]) or 0) end
    redis.call('HDEL', a, unpack(chunk))
  end
  redis.call('ZREMRANGEBYSCORE', w, '-inf', cutoff)
  local total = redis.call('DECRBY', t, freed)
  if total < 0 then redis.call('SET', t, 0, 'KEEPTTL') end
end
"""

# KEYS: record, then w, a, t, c per scope.
# ARGV: now, window, lease, request id, cost, window ttl ms, lease ttl ms,
#       record ttl ms, scope ids (JSON), concurrency retry_after, then rpm,
#       tpm, concurrency per scope.
# Returns: admitted, limit, failing scope index (1-based, 0 none), retry_after,
#   too_large, limit/remaining/reset requests, limit/remaining/reset tokens.
#   Floats travel as strings: Redis truncates Lua numbers to integers.
_RESERVE = _LUA_COMMON + """
local now, window, lease = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local rid, cost = ARGV[4], tonumber(ARGV[5])
local n = (#KEYS - 1) / 4
-- rpm (k = 0), tpm (1), concurrency (2) of scope i
local function limit(i, k) return tonumber(ARGV[8 + 3 * i + k]) end
-- A retried reserve of a request already charged (e.g. redelivered to another
-- dispatcher) is admitted without charging it twice.
local again = redis.call('EXISTS', KEYS[1]) == 1

local fail_kind, fail_scope, fail_retry, too_large = '', 0, -1, 0
local function fail(kind, i, retry)
  if too_large == 1 then return end
  if retry > fail_retry then fail_kind, fail_scope, fail_retry = kind, i, retry end
end

-- Seconds until the oldest entries, leaving in order, have freed `need` tokens.
local function tokens_free_at(w, a, need)
  local freed, start = 0, 0
  while true do
    local page = redis.call('ZRANGE', w, start, start + 63, 'WITHSCORES')
    if #page == 0 then return window end
    local ids = {}
    for j = 1, #page, 2 do ids[#ids + 1] = page[j] end
    local amounts = redis.call('HMGET', a, unpack(ids))
    for j = 1, #ids do
      freed = freed + (tonumber(amounts[j]) or 0)
      if freed >= need then return tonumber(page[2 * j]) + window - now end
    end
    start = start + 64
  end
end

local count, total, held = {}, {}, {}
for i = 1, n do
  local w, a, t, c = KEYS[4 * i - 2], KEYS[4 * i - 1], KEYS[4 * i], KEYS[4 * i + 1]
  local rpm, tpm, conc = limit(i, 0), limit(i, 1), limit(i, 2)
  if rpm > 0 or tpm > 0 then
    evict(w, a, t, now - window)
    count[i] = redis.call('ZCARD', w)
    total[i] = tonumber(redis.call('GET', t)) or 0
    if not again then
      if rpm > 0 and count[i] + 1 > rpm then
        local oldest = redis.call('ZRANGE', w, count[i] - rpm, count[i] - rpm, 'WITHSCORES')
        fail('requests', i, tonumber(oldest[2]) + window - now)
      end
      if tpm > 0 and cost > tpm then
        too_large, fail_kind, fail_scope, fail_retry = 1, 'tokens', i, 0
      elseif tpm > 0 and total[i] + cost > tpm then
        fail('tokens', i, tokens_free_at(w, a, total[i] + cost - tpm))
      end
    end
  end
  if conc > 0 then
    redis.call('ZREMRANGEBYSCORE', c, '-inf', now)
    held[i] = redis.call('ZCARD', c)
    if not again and held[i] + 1 > conc then fail('concurrency', i, tonumber(ARGV[10])) end
  end
end

local admitted = fail_kind == '' and 1 or 0
if admitted == 1 and not again then
  local holds = 0
  for i = 1, n do
    local w, a, t, c = KEYS[4 * i - 2], KEYS[4 * i - 1], KEYS[4 * i], KEYS[4 * i + 1]
    if count[i] then
      if redis.call('ZADD', w, now, rid) == 1 then
        count[i] = count[i] + 1
      else
        -- same id recorded earlier in this window (its record already gone)
        local before = tonumber(redis.call('HGET', a, rid)) or 0
        redis.call('DECRBY', t, before)
        total[i] = total[i] - before
      end
      redis.call('HSET', a, rid, cost)
      redis.call('INCRBY', t, cost)
      total[i] = total[i] + cost
      for _, k in ipairs({w, a, t}) do redis.call('PEXPIRE', k, ARGV[6]) end
    end
    if held[i] then
      redis.call('ZADD', c, now + lease, rid)
      redis.call('PEXPIRE', c, ARGV[7])
      held[i] = held[i] + 1
      holds = 1
    end
  end
  redis.call('HSET', KEYS[1], 'scopes', ARGV[9], 'tokens', cost, 'at', ARGV[1],
             'held', holds)
  redis.call('PEXPIRE', KEYS[1], ARGV[8])
end

-- Header values: per kind, the scope with the least remaining.
local ir, it = 0, 0
for i = 1, n do
  if count[i] then
    local rpm, tpm = limit(i, 0), limit(i, 1)
    if rpm > 0 and (ir == 0 or rpm - count[i] < limit(ir, 0) - count[ir]) then ir = i end
    if tpm > 0 and (it == 0 or tpm - total[i] < limit(it, 1) - total[it]) then it = i end
  end
end
-- Seconds until scope i holds none of its current entries.
local function reset(i)
  if i == 0 or count[i] == 0 then return 0 end
  local newest = redis.call('ZRANGE', KEYS[4 * i - 2], -1, -1, 'WITHSCORES')
  return math.max(0, tonumber(newest[2]) + window - now)
end
local lim_r, rem_r, reset_r, lim_t, rem_t, reset_t = 0, 0, 0, 0, 0, 0
if ir > 0 then lim_r, rem_r, reset_r = limit(ir, 0), limit(ir, 0) - count[ir], reset(ir) end
if it > 0 then
  lim_t, rem_t = limit(it, 1), limit(it, 1) - total[it]
  reset_t = it == ir and reset_r or reset(it)
end

return {admitted, fail_kind, fail_scope, tostring(math.max(fail_retry, 0)), too_large,
        lim_r, math.max(rem_r, 0), tostring(reset_r),
        lim_t, math.max(rem_t, 0), tostring(reset_t)}
"""

# KEYS: record, then w, a, t, c per scope (the scopes the record names).
# ARGV: request id, actual tokens. Returns 1 if applied, 0 if nothing to do.
_RECONCILE = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
local rid, actual = ARGV[1], tonumber(ARGV[2])
for i = 1, (#KEYS - 1) / 4 do
  local a, t = KEYS[4 * i - 1], KEYS[4 * i]
  -- only while the entry is still in the window; once evicted it was
  -- subtracted from the total and the adjustment would outlive it
  local reserved = tonumber(redis.call('HGET', a, rid))
  if reserved then
    redis.call('HSET', a, rid, actual)
    redis.call('INCRBY', t, actual - reserved)
  end
  redis.call('ZREM', KEYS[4 * i + 1], rid)
end
redis.call('DEL', KEYS[1])
return 1
"""

# KEYS: record, then w, a, t, c per scope. ARGV: request id.
_RELEASE = """
if redis.call('HGET', KEYS[1], 'held') ~= '1' then return 0 end
for i = 1, (#KEYS - 1) / 4 do redis.call('ZREM', KEYS[4 * i + 1], ARGV[1]) end
redis.call('HSET', KEYS[1], 'held', 0)
return 1
"""

_UNAVAILABLE = (
    rexc.ConnectionError,  # includes BusyLoadingError
    rexc.TimeoutError,
    rexc.ReadOnlyError,  # a replica promoted or demoted under us
    rexc.ClusterDownError,
    rexc.MasterDownError,
    rexc.SlotNotCoveredError,  # Redis Cluster: the slot's primary is down
    rexc.TryAgainError,
    OSError,
    TimeoutError,
)


class QuotaStore:
    """Quota state in Redis. Safe to share between tasks and between any number
    of dispatcher processes: all decisions happen inside Redis."""

    def __init__(self, redis: RedisClient, prefix: str = "tg", window: float = 60.0,
                 lease: float = 1800.0) -> None:
        if window <= 0 or lease <= 0:
            raise ValueError("window and lease must be > 0")
        if not prefix or "{" in prefix or "}" in prefix:
            raise ValueError(f"prefix must be non-empty and free of braces, got {prefix!r}")
        self.redis = redis
        self.window = window
        self.lease = lease
        self._base = f"{prefix}:{{{prefix}q}}"
        self._reserve = redis.register_script(_RESERVE)
        self._reconcile = redis.register_script(_RECONCILE)
        self._release = redis.register_script(_RELEASE)
        self._window_ttl_ms = _ms(window + _TTL_MARGIN)
        self._lease_ttl_ms = _ms(lease + _TTL_MARGIN)
        self._record_ttl_ms = _ms(max(window, lease) + _TTL_MARGIN)

    @property
    def scripts(self) -> tuple[Any, ...]:
        """The registered Lua scripts (preloaded by :func:`dispatcher.cluster.preload_scripts`)."""
        return (self._reserve, self._reconcile, self._release)

    @property
    def key_prefix(self) -> str:
        """Every key of this store starts with it, hash tag included."""
        return self._base + ":"

    def record_key(self, request_id: str) -> str:
        return f"{self._base}:r:{request_id}"

    def scope_keys(self, scope_id: str) -> list[str]:
        """The window (w, a, t) and lease (c) keys of one scope."""
        return [f"{self._base}:{kind}:{scope_id}" for kind in ("w", "a", "t", "c")]

    async def reserve(self, request_id: str, scopes: Sequence[Scope], tokens: int,
                      now: float | None = None) -> QuotaResult:
        """Charge ``tokens`` and one request to every scope, or to none.

        Scopes without limits are skipped. Reserving an id that is already
        charged admits it again without a second charge."""
        if not request_id:
            raise ValueError("request_id must not be empty")
        if tokens < 0:
            raise ValueError(f"tokens must be >= 0, got {tokens}")
        scopes = [s for s in scopes if s.limits.rpm or s.limits.tpm or s.limits.concurrency]
        ids = [s.id for s in scopes]
        if len(set(ids)) != len(ids):
            raise ValueError(f"duplicate scope ids in {ids}")
        if not scopes:
            return QuotaResult(admitted=True)
        now = time.time() if now is None else now
        keys = [self.record_key(request_id)]
        args: list[Any] = [repr(now), repr(self.window), repr(self.lease), request_id, tokens,
                           self._window_ttl_ms, self._lease_ttl_ms, self._record_ttl_ms,
                           json.dumps(ids), repr(_CONCURRENCY_RETRY)]
        for scope in scopes:
            keys.extend(self.scope_keys(scope.id))
            args.extend((scope.limits.rpm, scope.limits.tpm, scope.limits.concurrency))
        reply = await self._call(self._reserve, keys, args)
        (admitted, kind, failed, retry, too_large,
         lim_r, rem_r, reset_r, lim_t, rem_t, reset_t) = reply
        return QuotaResult(
            admitted=bool(admitted), limit=cast(LimitKind, _text(kind)),
            scope=ids[int(failed) - 1] if int(failed) else "",
            retry_after=float(retry), too_large=bool(too_large),
            limit_requests=int(lim_r), remaining_requests=int(rem_r),
            reset_requests=float(reset_r), limit_tokens=int(lim_t),
            remaining_tokens=int(rem_t), reset_tokens=float(reset_t))

    async def reconcile(self, request_id: str, actual_tokens: int,
                        now: float | None = None) -> None:
        """Replace the reserved amount by ``actual_tokens`` in every scope the
        request was charged to (while its entry is still in the window), and
        free its concurrency slot. A second call does nothing.

        ``now`` is accepted for symmetry with :meth:`reserve`: the adjustment
        applies to the entry at its original time, so the clock is not needed.
        """
        del now
        if actual_tokens < 0:
            raise ValueError(f"actual_tokens must be >= 0, got {actual_tokens}")
        keys = await self._keys_of(request_id)
        if keys is not None:
            await self._call(self._reconcile, keys, [request_id, actual_tokens])

    async def release(self, request_id: str) -> None:
        """Free the request's concurrency slot only (it ended without usage to
        report, e.g. its worker was lost). A second call does nothing."""
        keys = await self._keys_of(request_id)
        if keys is not None:
            await self._call(self._release, keys, [request_id])

    async def _keys_of(self, request_id: str) -> list[str] | None:
        record = self.record_key(request_id)
        raw = await self._retrying(lambda: self.redis.hget(record, "scopes"))
        if raw is None:
            return None  # never reserved, already reconciled, or expired
        keys = [record]
        for scope_id in json.loads(raw):
            keys.extend(self.scope_keys(scope_id))
        return keys

    async def _call(self, script: Any, keys: list[str], args: list[Any]) -> Any:
        async def run() -> Any:
            try:
                return await script(keys=keys, args=args)
            except rexc.NoScriptError:
                # The script cache of the node holding the keys is empty (it
                # restarted) and redis-py's reload (SCRIPT LOAD on every
                # primary, on a cluster) failed, e.g. another primary is down.
                # EVAL runs it on the keys' node and caches it there.
                return await self.redis.eval(script.script, len(keys), *keys, *args)

        return await self._retrying(run)

    async def _retrying(self, call: Callable[[], Awaitable[Any]]) -> Any:
        """``call()``, once more if a pooled connection closed under it.

        redis-py's cluster client disconnects a node's connections after one
        error, and a command caught writing on such a transport raises a
        non-Redis error (redis-py issue 4287). Every call here is idempotent
        per request id (a second reserve admits without charging again), so
        one retry on a fresh connection is safe.
        """
        try:
            try:
                return await call()
            except TRANSPORT_RACE:
                return await call()
        except _UNAVAILABLE + TRANSPORT_RACE as exc:
            raise QuotaUnavailable(_describe(exc)) from exc


def _ms(seconds: float) -> int:
    return math.ceil(seconds * 1000)


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _describe(exc: BaseException) -> str:
    return f"redis: {type(exc).__name__}: {exc}" if str(exc) else f"redis: {type(exc).__name__}"
