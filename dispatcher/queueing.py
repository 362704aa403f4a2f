"""Queue mode: when a model's backend gets slow, admit only what it handled well.

State shared by every dispatcher lives in Redis under the quota store's hash
tag (one slot, so each script is atomic on Redis Cluster): ``qm:<model>`` (mode,
limit, last p99, streaks, peak), ``lat:<model>:<w>`` and ``peak:<model>:<w>``
per window, and the fair queue ``q:<model>:...``. Fairness: the best class
waiting goes first (``tidegate.wire.classes``); within a class tenants share
by tokens (start-time fair queueing: a grant adds its reserved tokens / its
tier's weight to its tenant's virtual time, and the tenant furthest behind
goes next), a tenant's requests oldest first.
Ownership: the dispatcher that queued a request keeps its JetStream message
unacked until a grant; if it dies, the redelivery's enqueue takes the entry
over, so a queued request is never lost nor dispatched twice. Docs:
docs/queue-mode.md#redis-keys.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from dispatcher.quota import QuotaUnavailable
from dispatcher.redis_client import RedisClient
from tidegate.config import QueueModeConfig
from tidegate.wire import classes
from tidegate.wire.subjects import encode_token

# How many requests will be granted before ``rid`` of ``tenant`` (1 = next):
# its own better-class and older same-class requests, every other tenant's
# better-class ones, and one turn per tenant with work of its class each round,
# those before it in turn order this round. Counted in requests, as if each
# were of the same size: an estimate once tokens weigh the turns (_GRANT).
_POSITION = """
local function position(base, tenant, rid)
  local tkey = base .. ':t:' .. tenant
  local score = redis.call('ZSCORE', tkey, rid)
  if not score then return 0 end
  local lo = math.floor(tonumber(score) / 1e15) * 1e15
  local hi = '(' .. (lo + 1e15)
  local mine = redis.call('ZCOUNT', tkey, '-inf', '(' .. lo)
  local rounds = redis.call('ZCOUNT', tkey, lo, '(' .. score)
  local ahead, same, before, passed = 0, 1, 0, false
  for _, other in ipairs(redis.call('ZRANGE', base .. ':tenants', 0, -1)) do
    if other == tenant then passed = true
    else
      local okey = base .. ':t:' .. other
      ahead = ahead + redis.call('ZCOUNT', okey, '-inf', '(' .. lo)
      if redis.call('ZCOUNT', okey, lo, hi) > 0 then
        same = same + 1
        if not passed then before = before + 1 end
      end
    end
  end
  return mine + ahead + rounds * same + before + 1
end
"""

# Taking a request out of the queue (granted, expired or displaced): every
# count and index it is in, once. A tenant left with nothing waiting leaves
# the turn order; its virtual time is kept an hour (``vt``), so one that comes
# back at once still owes for what it was just granted.
_REMOVE = """
local function leave(base, tenant)
  local vt = redis.call('ZSCORE', base .. ':tenants', tenant)
  if vt then
    redis.call('HSET', base .. ':vt', tenant, vt)
    redis.call('PEXPIRE', base .. ':vt', 3600000)
  end
  redis.call('ZREM', base .. ':tenants', tenant)
end
local function remove(base, rid, state)
  local rkey = base .. ':r:' .. rid
  local tenant = redis.call('HGET', rkey, 'tenant')
  local owner = redis.call('HGET', rkey, 'owner') or ''
  local class = redis.call('HGET', rkey, 'class')
  if class then redis.call('DECR', base .. ':n:' .. class) end
  redis.call('ZREM', base .. ':deadlines', rid)
  if tenant then
    local tkey = base .. ':t:' .. tenant
    redis.call('ZREM', tkey, rid)
    if redis.call('ZCARD', tkey) == 0 then leave(base, tenant) end
  end
  redis.call('HSET', rkey, 'state', state)
  redis.call('DECR', base .. ':n')
  return owner
end
"""

# enqueue: KEYS = base (prefix of this model's queue keys). ARGV = request id,
# tenant, class rank (tidegate.wire.classes.rank), owner, now ms, ttl ms, bound,
# cost (its reserved tokens / its tier's weight). Returns {state, position}:
# state is queued / granted / full / expired / displaced. A full queue makes
# room for a better class: the newest request of the worst class waiting, if
# worse than this one, is displaced (its owner learns it from positions).
_ENQUEUE = _POSITION + _REMOVE + """
local base, rid, tenant, class = KEYS[1], ARGV[1], ARGV[2], tonumber(ARGV[3])
local owner, now, ttl, bound = ARGV[4], tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7])
local cost = tonumber(ARGV[8])
local rkey = base .. ':r:' .. rid
local state = redis.call('HGET', rkey, 'state')
if state then
  redis.call('HSET', rkey, 'owner', owner)
  return {state, 0}
end
local n = tonumber(redis.call('GET', base .. ':n') or '0')
if n >= bound then
  local victim, worst = nil, (class + 1) * 1e15
  for _, other in ipairs(redis.call('ZRANGE', base .. ':tenants', 0, -1)) do
    local tail = redis.call('ZRANGE', base .. ':t:' .. other, -1, -1, 'WITHSCORES')
    if #tail > 0 and tonumber(tail[2]) >= worst then victim, worst = tail[1], tonumber(tail[2]) end
  end
  if victim == nil then return {'full', n} end
  remove(base, victim, 'displaced')
end
local tkey = base .. ':t:' .. tenant
redis.call('ZADD', tkey, class * 1e15 + now, rid)
if not redis.call('ZSCORE', base .. ':tenants', tenant) then
  local clock = tonumber(redis.call('GET', base .. ':turn') or '0')
  local owed = tonumber(redis.call('HGET', base .. ':vt', tenant) or '0')
  redis.call('HDEL', base .. ':vt', tenant)
  redis.call('ZADD', base .. ':tenants', math.max(clock, owed), tenant)
end
redis.call('ZADD', base .. ':deadlines', now + ttl, rid)
redis.call('HSET', rkey, 'owner', owner, 'tenant', tenant, 'state', 'queued', 'class', class,
           'cost', cost)
redis.call('PEXPIRE', rkey, ttl + 3600000)
redis.call('INCR', base .. ':n')
redis.call('INCR', base .. ':n:' .. class)
return {'queued', position(base, tenant, rid)}
"""

# grant: KEYS = base. ARGV = capacity, now ms. Expires overdue entries, then
# grants up to capacity: each time the best class any tenant has waiting, from
# the tenant of least virtual time among those (a tenant's queue is ordered by
# class, then age, so its head is its best). The grant sets the virtual clock
# (``turn``: where a tenant that starts waiting begins) to that tenant's time
# and adds the request's cost to it. Returns a flat list {kind, rid, owner, ...}
# with kind 'g' (granted) or 'x' (expired).
_GRANT = _REMOVE + """
local base, capacity, now = KEYS[1], tonumber(ARGV[1]), tonumber(ARGV[2])
local out = {}
local function take(rid, kind)
  local owner = remove(base, rid, kind == 'g' and 'granted' or 'expired')
  table.insert(out, kind); table.insert(out, rid); table.insert(out, owner)
end
local overdue = redis.call('ZRANGEBYSCORE', base .. ':deadlines', '-inf', now, 'LIMIT', 0, 256)
for _, rid in ipairs(overdue) do take(rid, 'x') end
while capacity > 0 do
  local best, pick, rid = nil, nil, nil
  for _, tenant in ipairs(redis.call('ZRANGE', base .. ':tenants', 0, -1)) do
    local head = redis.call('ZRANGE', base .. ':t:' .. tenant, 0, 0, 'WITHSCORES')
    if #head == 0 then
      leave(base, tenant)
    else
      local class = math.floor(tonumber(head[2]) / 1e15)
      if best == nil or class < best then best, pick, rid = class, tenant, head[1] end
    end
  end
  if pick == nil then break end
  local vt = tonumber(redis.call('ZSCORE', base .. ':tenants', pick))
  local cost = tonumber(redis.call('HGET', base .. ':r:' .. rid, 'cost') or '1')
  redis.call('SET', base .. ':turn', vt)
  redis.call('ZADD', base .. ':tenants', 'XX', vt + cost, pick)
  take(rid, 'g')
  capacity = capacity - 1
end
return out
"""

# positions: KEYS = base. ARGV = request ids. Each one's position (see
# _POSITION); -1 = already granted, -2 = expired, -3 = displaced (so an owner
# whose grant message was lost, or who was never told, still learns it).
_POSITIONS = _POSITION + """
local base = KEYS[1]
local out = {}
for i, rid in ipairs(ARGV) do
  local rkey = base .. ':r:' .. rid
  local state = redis.call('HGET', rkey, 'state')
  local tenant = redis.call('HGET', rkey, 'tenant')
  local pos = 0
  if state == 'granted' then pos = -1
  elseif state == 'expired' then pos = -2
  elseif state == 'displaced' then pos = -3
  elseif tenant then pos = position(base, tenant, rid)
  end
  out[i] = pos
end
return out
"""


# KEYS[1] = counter; ARGV = value, ttl ms. Keeps the largest value seen.
_KEEP_MAX = """
local v = tonumber(redis.call('GET', KEYS[1]) or '-1')
if tonumber(ARGV[1]) > v then redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2]) end
"""


@dataclass(frozen=True, slots=True)
class ModeState:
    queueing: bool = False
    limit: int = 0
    p99_ms: float = 0.0


@dataclass(frozen=True, slots=True)
class Grant:
    request_id: str
    owner: str
    granted: bool  # False: expired in the queue


def p99(samples: Sequence[float]) -> float:
    """Nearest-rank 99th percentile."""
    ordered = sorted(samples)
    return ordered[max(0, math.ceil(0.99 * len(ordered)) - 1)]


class QueueMode:
    """Queue-mode state and the fair queue of one deployment, in Redis."""

    def __init__(self, redis: RedisClient, prefix: str) -> None:
        self.redis = redis
        self._base = f"{prefix}:{{{prefix}q}}"
        self._enqueue = redis.register_script(_ENQUEUE)
        self._grant = redis.register_script(_GRANT)
        self._positions = redis.register_script(_POSITIONS)

    @property
    def scripts(self) -> tuple[Any, ...]:
        """The registered Lua scripts (preloaded by
        :func:`dispatcher.redis_client.preload_scripts`)."""
        return (self._enqueue, self._grant, self._positions)

    def state_key(self, model: str) -> str:
        return f"{self._base}:qm:{encode_token(model)}"

    def queue_key(self, model: str) -> str:
        """The model's fair queue (its per-class counts: ``<key>:n:<rank>``)."""
        return f"{self._base}:q:{encode_token(model)}"

    async def _run(self, coro: Any) -> Any:
        try:
            return await coro
        except Exception as exc:  # redis errors of every kind: the caller degrades
            raise QuotaUnavailable(f"queue store: {type(exc).__name__}: {exc}") from exc

    # -- measurements -----------------------------------------------------------

    async def record_ttft(self, model: str, ttft_ms: float, now: float,
                          cfg: QueueModeConfig) -> None:
        w = int(now // cfg.window)
        key = f"{self._base}:lat:{encode_token(model)}:{w}"
        pipe = self.redis.pipeline(transaction=False)
        pipe.rpush(key, round(ttft_ms, 3))
        pipe.pexpire(key, int(cfg.window * (cfg.enter_after + cfg.exit_after + 2) * 1000))
        await self._run(pipe.execute())

    async def state(self, model: str) -> ModeState:
        raw = await self._run(self.redis.hgetall(self.state_key(model)))
        return ModeState(queueing=raw.get("mode") == "queue", limit=int(raw.get("limit", 0)),
                         p99_ms=float(raw.get("p99_ms", 0.0)))

    async def evaluate(self, model: str, running: int, now: float,
                       cfg: QueueModeConfig) -> ModeState:
        """Fold finished windows into the mode; call from one dispatcher at a
        time (see :meth:`lead`). ``running`` is the jobs in flight now."""
        tok = encode_token(model)
        skey = self.state_key(model)
        w_now = int(now // cfg.window)
        peak_key = f"{self._base}:peak:{tok}:{w_now}"
        pipe = self.redis.pipeline(transaction=False)
        pipe.hgetall(skey)
        pipe.eval(_KEEP_MAX, 1, peak_key, running, int(cfg.window * 10 * 1000))
        raw, _ = await self._run(pipe.execute())
        mode = raw.get("mode", "normal")
        bad, good = int(raw.get("bad", 0)), int(raw.get("good", 0))
        limit, good_peak = int(raw.get("limit", 0)), int(raw.get("good_peak", 0))
        last_w = int(raw.get("last_w", w_now - 1))
        p99_ms = float(raw.get("p99_ms", 0.0))
        threshold_ms = cfg.ttft_p99 * 1000
        for w in range(max(last_w + 1, w_now - 5), w_now):
            samples = await self._run(self.redis.lrange(f"{self._base}:lat:{tok}:{w}", 0, -1))
            peak = int(await self._run(self.redis.get(f"{self._base}:peak:{tok}:{w}")) or 0)
            if not samples:
                continue  # no traffic, no evidence either way
            p99_ms = p99([float(s) for s in samples])
            if p99_ms > threshold_ms:
                bad, good = bad + 1, 0
            elif mode == "normal" or p99_ms < threshold_ms * cfg.exit_ratio:
                good, bad = good + 1, 0
                if mode == "normal":
                    good_peak = max(peak, 1)
            else:
                bad = good = 0  # in queue mode, merely under the threshold is not recovery
            if mode == "normal" and bad >= cfg.enter_after:
                mode, limit, good = "queue", max(cfg.min_concurrency, good_peak), 0
            elif mode == "queue" and good >= cfg.exit_after:
                mode, bad = "normal", 0
        await self._run(self.redis.hset(skey, mapping={
            "mode": mode, "bad": bad, "good": good, "limit": limit, "good_peak": good_peak,
            "last_w": max(last_w, w_now - 1), "p99_ms": round(p99_ms, 3)}))
        return ModeState(queueing=mode == "queue", limit=limit, p99_ms=p99_ms)

    async def lead(self, model: str, owner: str, hold: float) -> bool:
        """True if this dispatcher evaluates and grants for ``model`` now: one
        at a time, so grants never overshoot the limit from a stale count."""
        key = f"{self._base}:lead:{encode_token(model)}"
        ok = await self._run(self.redis.set(key, owner, px=int(hold * 1000), nx=True))
        if ok:
            return True
        return bool(await self._run(self.redis.get(key)) == owner)

    # -- the fair queue ------------------------------------------------------------

    async def enqueue(self, model: str, request_id: str, tenant: str, klass: str, owner: str,
                      now: float, cfg: QueueModeConfig, cost: float = 1.0,
                      ttl: float | None = None) -> tuple[str, int]:
        """Queue a request of class ``klass`` (tidegate.wire.classes) that
        costs ``cost`` turns (its reserved tokens / its tenant's tier weight)
        for ``ttl`` seconds (its class's TTL by default)."""
        ttl = cfg.ttl_for(klass) if ttl is None else ttl
        state, position = await self._run(self._enqueue(
            keys=[self.queue_key(model)],
            args=[request_id, encode_token(tenant), classes.rank(klass), owner,
                  int(now * 1000), int(ttl * 1000), cfg.max_queued,
                  repr(max(float(cost), 1e-6))]))
        return str(state), int(position)

    async def queued(self, model: str) -> int:
        return int(await self._run(self.redis.get(f"{self.queue_key(model)}:n")) or 0)

    async def queued_by_class(self, model: str) -> dict[str, int]:
        """How many requests of each class wait (tidegate.wire.classes)."""
        base = self.queue_key(model)
        counts = await self._run(self.redis.mget(
            [f"{base}:n:{i}" for i in range(len(classes.CLASSES))]))
        return {klass: max(0, int(n or 0)) for klass, n in zip(classes.CLASSES, counts,
                                                                  strict=True)}

    async def grant(self, model: str, capacity: int, now: float) -> list[Grant]:
        flat = await self._run(self._grant(keys=[self.queue_key(model)],
                                           args=[max(0, capacity), int(now * 1000)]))
        return [Grant(flat[i + 1], flat[i + 2], flat[i] == "g") for i in range(0, len(flat), 3)]

    async def positions(self, model: str, request_ids: Sequence[str]) -> list[int]:
        if not request_ids:
            return []
        out = await self._run(self._positions(keys=[self.queue_key(model)], args=list(request_ids)))
        return [int(p) for p in out]
