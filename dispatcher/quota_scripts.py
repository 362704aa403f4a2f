"""The quota store's Lua scripts (:mod:`dispatcher.quota` runs them).

Kept apart from the store so each file stays readable; the algorithm and the
key layout are described in :mod:`dispatcher.quota`.
"""

# --------------------------------------------------------------------------
# Scripts
# --------------------------------------------------------------------------

# Shared helpers. A window's keys are w (zset id->time), a (hash id->tokens),
# t (token total); c is the concurrency lease zset (id->expiry).
LUA_COMMON = """
-- Exact integers past 2^53: Lua's numbers are doubles, so an amount of money
-- (nano-units, up to Redis's 64-bit counters) is a pair {units, nanos}, value
-- units * 10^9 + nanos with 0 <= nanos < 10^9; each part stays far below 2^53.
-- Amounts reach Redis as decimal strings (ARGV, INCRBY, HSET), never as Lua
-- numbers, which Redis would print with 17 significant digits.
local NANO = 1000000000
local function m_norm(units, nanos)
  local carry = math.floor(nanos / NANO)
  return {units + carry, nanos - carry * NANO}
end
local function m_of(n)  -- a Lua number below 2^53 (token counts)
  local units = math.floor(n / NANO)
  return {units, n - units * NANO}
end
local function m_parse(s)
  if s == nil or s == false then return {0, 0} end
  s = tostring(s)
  local sign, digits = string.match(s, '^(%-?)(%d+)$')
  if not digits then return m_of(math.floor(tonumber(s) or 0)) end  -- not ours: "1e+17"
  local n = #digits
  local v = {0, tonumber(digits)}
  if n > 9 then
    v = {tonumber(string.sub(digits, 1, n - 9)), tonumber(string.sub(digits, n - 8))}
  end
  if sign == '-' then v = m_norm(-v[1], -v[2]) end
  return v
end
local function m_add(x, y) return m_norm(x[1] + y[1], x[2] + y[2]) end
local function m_sub(x, y) return m_norm(x[1] - y[1], x[2] - y[2]) end
local function m_cmp(x, y)
  if x[1] ~= y[1] then return x[1] < y[1] and -1 or 1 end
  if x[2] ~= y[2] then return x[2] < y[2] and -1 or 1 end
  return 0
end
local ZERO = {0, 0}
local function m_str(x)
  if x[1] < 0 then return '-' .. m_str(m_sub(ZERO, x)) end
  if x[1] == 0 then return string.format('%d', x[2]) end
  return string.format('%d%09d', x[1], x[2])
end

local function evict(w, a, t, cutoff)
  local old = redis.call('ZRANGEBYSCORE', w, '-inf', cutoff)
  if #old == 0 then return end
  local freed = ZERO
  -- bounded unpack(): Lua's stack holds a few thousand values at most
  for i = 1, #old, 1000 do
    local chunk = {unpack(old, i, math.min(i + 999, #old))}
    local amounts = redis.call('HMGET', a, unpack(chunk))
    for j = 1, #amounts do freed = m_add(freed, m_parse(amounts[j])) end
    redis.call('HDEL', a, unpack(chunk))
  end
  redis.call('ZREMRANGEBYSCORE', w, '-inf', cutoff)
  local total = redis.call('DECRBY', t, m_str(freed))
  if total < 0 then redis.call('SET', t, 0, 'KEEPTTL') end
end
"""

# KEYS: record, then w, a, t, c per scope, then w, a, t per budget.
# ARGV: now, window, lease, request id, cost, window ttl ms, lease ttl ms,
#       record ttl ms, scope ids (JSON), concurrency retry_after, number of
#       scopes, money (nano-units), budget key bases (JSON), budget kinds
#       ("c" calendar / "r" rolling per budget), then rpm, tpm, concurrency per
#       scope, then limit, window (0: calendar), ttl ms, reset_in, soft per budget.
# Returns: admitted, limit, failing scope index (1-based over scopes then
#   budgets, 0 none), retry_after, too_large, limit/remaining/reset requests,
#   limit/remaining/reset tokens, remaining budget (nano-units, -1 none),
#   each budget's spend after this call.
#   Floats travel as strings (Redis truncates Lua numbers to integers), and
#   so does money (exact decimal integers, see m_parse).
RESERVE = LUA_COMMON + """
local now, window, lease = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local rid, cost = ARGV[4], tonumber(ARGV[5])
local n, money = tonumber(ARGV[11]), m_parse(ARGV[12])
local m = (#KEYS - 1 - 4 * n) / 3
-- rpm (k = 0), tpm (1), concurrency (2) of scope i
local function limit(i, k) return tonumber(ARGV[12 + 3 * i + k]) end
-- limit (k = 1, see budget_limit), window (2), ttl ms (3), reset_in (4), soft (5)
-- of budget j
local function blim(j, k) return tonumber(ARGV[14 + 3 * n + 5 * (j - 1) + k]) end
local function budget_limit(j) return m_parse(ARGV[15 + 3 * n + 5 * (j - 1)]) end
local function bkeys(j)
  local k0 = 1 + 4 * n + 3 * (j - 1)
  return KEYS[k0 + 1], KEYS[k0 + 2], KEYS[k0 + 3]
end
-- A retried reserve of a request already charged (e.g. redelivered to another
-- dispatcher) is admitted without charging it twice.
local again = redis.call('EXISTS', KEYS[1]) == 1

local fail_kind, fail_scope, fail_retry, too_large = '', 0, -1, 0
local function fail(kind, i, retry)
  if too_large == 1 then return end
  if retry > fail_retry then fail_kind, fail_scope, fail_retry = kind, i, retry end
end

-- Seconds until the oldest entries, leaving in order, have freed `need` tokens
-- (or nano-units; both as {units, nanos}) of a window of `win` seconds.
local function tokens_free_at(w, a, need, win)
  local freed, start = ZERO, 0
  while true do
    local page = redis.call('ZRANGE', w, start, start + 63, 'WITHSCORES')
    if #page == 0 then return win end
    local ids = {}
    for j = 1, #page, 2 do ids[#ids + 1] = page[j] end
    local amounts = redis.call('HMGET', a, unpack(ids))
    for j = 1, #ids do
      freed = m_add(freed, m_parse(amounts[j]))
      if m_cmp(freed, need) >= 0 then return tonumber(page[2 * j]) + win - now end
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
        fail('tokens', i, tokens_free_at(w, a, m_of(total[i] + cost - tpm), window))
      end
    end
  end
  if conc > 0 then
    redis.call('ZREMRANGEBYSCORE', c, '-inf', now)
    held[i] = redis.call('ZCARD', c)
    if not again and held[i] + 1 > conc then fail('concurrency', i, tonumber(ARGV[10])) end
  end
end

-- Budgets: money spent in the calendar period (t only; a reservation's amount
-- is in the record) or in the rolling window (w, a, t like a token window).
local spent = {}
for j = 1, m do
  local w, a, t = bkeys(j)
  local win = blim(j, 2)
  if win > 0 then evict(w, a, t, now - win) end
  spent[j] = m_parse(redis.call('GET', t))
  if not again and blim(j, 5) == 0 then
    local over = m_sub(m_add(spent[j], money), budget_limit(j))
    if m_cmp(money, budget_limit(j)) > 0 then
      too_large, fail_kind, fail_scope, fail_retry = 1, 'budget', n + j, 0
    elseif m_cmp(over, ZERO) > 0 then
      local retry = blim(j, 4)
      if win > 0 then retry = tokens_free_at(w, a, over, win) end
      fail('budget', n + j, retry)
    end
  end
end

local admitted = fail_kind == '' and 1 or 0
if admitted == 1 and not again then
  for j = 1, m do
    local w, a, t = bkeys(j)
    if blim(j, 2) > 0 then
      redis.call('ZADD', w, now, rid)
      redis.call('HSET', a, rid, ARGV[12])
    end
    redis.call('INCRBY', t, ARGV[12])
    spent[j] = m_add(spent[j], money)
    for _, k in ipairs({w, a, t}) do redis.call('PEXPIRE', k, blim(j, 3)) end
  end
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
             'held', holds, 'budgets', ARGV[13], 'kinds', ARGV[14], 'money', ARGV[12])
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

local rem_b, spends = nil, {}
for j = 1, m do
  spends[j] = m_str(spent[j])
  if blim(j, 5) == 0 then
    local left = m_sub(budget_limit(j), spent[j])
    if m_cmp(left, ZERO) < 0 then left = ZERO end
    if rem_b == nil or m_cmp(left, rem_b) < 0 then rem_b = left end
  end
end

return {admitted, fail_kind, fail_scope, tostring(math.max(fail_retry, 0)), too_large,
        lim_r, math.max(rem_r, 0), tostring(reset_r),
        lim_t, math.max(rem_t, 0), tostring(reset_t), rem_b and m_str(rem_b) or '-1', spends}
"""

# KEYS: record, then w, a, t, c per scope, then w, a, t per budget (as the
# record names them). ARGV: request id, actual tokens, number of scopes,
# actual money (nano-units). Returns 1 if applied, 0 if nothing to do.
RECONCILE = LUA_COMMON + """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
local rid, actual, n = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
for i = 1, n do
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
local money = m_parse(ARGV[4])
local kinds = redis.call('HGET', KEYS[1], 'kinds') or ''
local reserved_money = m_parse(redis.call('HGET', KEYS[1], 'money'))
for j = 1, (#KEYS - 1 - 4 * n) / 3 do
  local k0 = 1 + 4 * n + 3 * (j - 1)
  local a, t = KEYS[k0 + 2], KEYS[k0 + 3]
  if string.sub(kinds, j, j) == 'r' then
    local reserved = redis.call('HGET', a, rid)
    if reserved then
      redis.call('HSET', a, rid, ARGV[4])
      redis.call('INCRBY', t, m_str(m_sub(money, m_parse(reserved))))
    end
  elseif redis.call('EXISTS', t) == 1 then
    -- the calendar period's total (kept a day past its end); INCRBY keeps its TTL
    redis.call('INCRBY', t, m_str(m_sub(money, reserved_money)))
  end
end
redis.call('DEL', KEYS[1])
return 1
"""

# KEYS: record, then w, a, t, c per scope, then w, a, t per budget.
# ARGV: request id, number of scopes.
RELEASE = """
if redis.call('HGET', KEYS[1], 'held') ~= '1' then return 0 end
for i = 1, tonumber(ARGV[2]) do redis.call('ZREM', KEYS[4 * i + 1], ARGV[1]) end
redis.call('HSET', KEYS[1], 'held', 0)
return 1
"""
