-- multi_rule.lua: all rules of one request in one atomic step (mixed algorithms).
-- KEYS[1]        decision (idempotency) record key
-- KEYS[2..n+1]   one state key per rule; all keys share the tenant hash tag (one slot); 1 <= n <= 8;
--                rule keys must be distinct
-- ARGV[1]        ttl_slack_ms (>= 0)
-- ARGV[2]        decision_ttl_ms (0 = no record)
-- ARGV[3]        member: the decision id (sliding-log entry id, concurrency slot id)
-- ARGV[4+6i..]   rule i (0-based): kind, p1, p2, p3, p4, p5 (unused params 0, ignored)
--                  tb    capacity, refill, period_ms, cost, 0   (millitokens / ms)
--                  gcra  capacity, refill, period_ms, cost, 0   (millitokens / ms)
--                  fw    limit, window_ms, cost, 0, 0           (units)
--                  sc    limit, window_ms, cost, 0, 0           (units)
--                  sl    limit, window_ms, cost, 0, 0           (entries, cost <= 1000; member, member#2, ..)
--                  cc    max_in_flight, lease_ttl_ms, 0, 0, 0   (lease id = member)
--                  pool  cost_tokens, 0, 0, 0, 0                (leased global tokens)
--                  pw    limit, k_lo, k_hi, cost, ttl_ms        (a pool's fallback allowance per
--                                                               allocator window, lib/pool_window.lua)
-- ARGV[4+6n]     question: what the decision id is asked about, stored with the record and
--                compared on a replay (the agent sends a keyed hash of tenant, principal, route
--                group and cost; 0..64 characters of [0-9A-Za-z]; '' when no record is kept)
-- Reply          {allowed 0/1, denied_by (1-based, 0 = none), retry_after_ms, remaining_1 ..
--                remaining_n}; remaining is the value after the debit when the request is
--                allowed, and every rule's current (undebited) value when it is denied; a cc
--                rule reports in_flight in its slot.
--                {-1, 0, 0, 0 .. 0} (n zeros): the decision id has a record for another
--                question (conflict); only the record was read, nothing was written.
-- Semantics      every argument is validated before any read/write (error reply
--                'ERR rate limit policy arguments invalid'). With decision_ttl_ms > 0 a stored
--                record is returned unchanged when it was written for the same question, and the
--                conflict reply otherwise (a record never answers another question: a caller
--                who reuses someone's decision id is neither admitted nor charged by it; a
--                record without a question, or of any other shape, is a conflict too). Each
--                rule's check (lib/*.lua, reads only) runs
--                in order; denied_by = first denying rule; retry = max over denying rules, -1 if
--                any denying rule can never succeed; cc and pool denials contribute their own
--                hint (0 for cc: the caller uses its policy Retry-After). Only when no rule denies
--                does every rule commit (writes + expiries); a denial writes nothing but the
--                decision record. The concurrency slot is therefore only added when all rate
--                rules allow: this is "acquire lease first, debit rates second,
--                idempotently release the lease when a rate rule denies", folded into one atomic
--                step with the same observable outcome and no window where a doomed lease is held.
--                With decision_ttl_ms > 0 the reply (also a denial) is stored with PX
--                decision_ttl_ms as 'question|' followed by comma-separated integers (exact for
--                every value < 2^53) — except a denial by a leased pool (kind pool): the agent runs
--                the decision again once the region's balance is topped up, and a denial debited
--                nothing, so it is not recorded (a recorded one would replay the denial to that
--                second run).
-- @include lib/clock.lua
-- The script loader replaces the next line by an include of every call kind's library and the
-- dispatch table `local ALG = { <kind> = <TABLE>, ... }`, from the registry of kinds
-- (kernel.algorithms.KINDS: the bundle's algorithms tb, gcra, fw, sc, sl, pool, and cc, pw).
-- @kinds
local MAX_RULES = 8

local n = #KEYS - 1
local slack, dec_ttl = lh_int(ARGV[1], 0), lh_int(ARGV[2], 0)
local member = ARGV[3]
local question = ARGV[4 + 6 * n]
if n < 1 or n > MAX_RULES or #ARGV ~= 4 + 6 * n or slack == nil or dec_ttl == nil
    or member == nil or question == nil or #question > 64 or string.find(question, '[^%w]') then
  return lh_invalid()
end

-- each rule's algorithm and parameters, parsed where they are in ARGV; rule keys distinct
local algs, params, plans = {}, {}, {}
for i = 1, n do
  local b = 4 + 6 * (i - 1)
  local alg, key = ALG[ARGV[b]], KEYS[i + 1]
  if alg == nil then
    return lh_invalid()
  end
  for j = 2, i do
    if KEYS[j] == key then
      return lh_invalid()
    end
  end
  local P = alg.parse(ARGV, b)
  if P == nil or (alg.needs_member and member == '') then
    return lh_invalid()
  end
  algs[i], params[i] = alg, P
end

if dec_ttl > 0 then
  local prior = redis.call('GET', KEYS[1])
  if prior then
    local asked, stored = string.match(prior, '^(%w*)|([-%d,]+)$')
    if asked ~= question then
      local conflict = { -1, 0, 0 }
      for i = 1, n do
        conflict[3 + i] = 0
      end
      return conflict
    end
    local out = {}
    for x in string.gmatch(stored, '[^,]+') do
      out[#out + 1] = tonumber(x)
    end
    return out
  end
end

local now = lh_now()
local denied_by, retry, never = 0, 0, false
for i = 1, n do
  local plan = algs[i].check(KEYS[i + 1], params[i], now, member)
  plans[i] = plan
  if not plan.ok then
    if denied_by == 0 then denied_by = i end
    if plan.retry < 0 then
      never = true
    else
      retry = math.max(retry, plan.retry)
    end
  end
end
if never then retry = -1 end

local result = { 0, denied_by, retry }
if denied_by == 0 then
  result[1] = 1
  for i = 1, n do
    algs[i].commit(KEYS[i + 1], params[i], plans[i], now, slack, member)
  end
end
for i = 1, n do
  local plan = plans[i]
  result[3 + i] = (denied_by == 0 or plan.current == nil) and plan.remaining or plan.current
end
if dec_ttl > 0 and not (denied_by > 0 and algs[denied_by].unrecorded_denial) then
  -- one string.format of every value: each '%d' formats its value as a format of that value alone
  -- would, so the record is the same text as the values formatted one by one and joined by ','
  local values = string.format('%d' .. string.rep(',%d', #result - 1), unpack(result))
  redis.call('SET', KEYS[1], question .. '|' .. values, 'PX', dec_ttl)
end
return result
