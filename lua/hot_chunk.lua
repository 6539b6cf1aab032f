-- hot_chunk.lua: a chunk for a hot key set: up to `want` units of one request's rules taken at
-- once, charged with multi_rule.lua's semantics (the same libraries' check and commit; every rule
-- charged, all or nothing), to be spent by the agent without a store call per request.
-- KEYS[1..n]     the request's rule keys (one slot: the tenant hash tag); 1 <= n <= 8; distinct
-- ARGV[1]        ttl_slack_ms (>= 0)
-- ARGV[2]        member: the chunk's id, unique per take (a sliding log's entries: member,
--                member#2, ..)
-- ARGV[3]        min units (>= 1)
-- ARGV[4]        want units (>= min)
-- ARGV[5+6i..]   rule i (0-based): kind, p1 .. p5 for a request of ONE unit (multi_rule.lua's
--                table); kinds tb, gcra, fw, sc, sl, pool (cc and pw are refused: a concurrency
--                lease is per request, a fallback allowance is not a tenant's bucket). A request
--                of k units is the same slot with its cost parameter x k (tb, gcra: p4; fw, sc,
--                sl: p3; pool: p1).
-- Reply          {taken, valid_for_ms, allowed, denied_by, retry_after_ms, remaining_1 .. remaining_n}
--                taken: the largest k in [min, want] for which no rule denies a request of k
--                  units (a k beyond a rule's argument range counts as denied); 0 when a request
--                  of min units is denied: nothing is written;
--                allowed .. remaining_n: multi_rule.lua's reply (without a decision record) for a
--                  request of `taken` units, or, when nothing was taken, of `min` units (the
--                  denial's retry hint and every rule's current value);
--                valid_for_ms: how long the taken units may be spent: the least, over the rules,
--                  of the ms until a fixed window's or a sliding counter's current window ends
--                  and until the earliest-expiring lease a pool slot was debited from ends; -1
--                  when no rule bounds it (token bucket, GCRA, sliding log: the agent's own
--                  validity bounds the chunk); 0 when nothing was taken.
-- Semantics      every argument is validated before any read or write (error reply
--                'ERR rate limit policy arguments invalid'); checks only read, so the search for
--                k (the largest first, then halving) writes nothing; only the chosen k commits,
--                every rule's state and expiry as multi_rule.lua would for one request of k units.
-- @include lib/clock.lua
-- @kinds
local MAX_RULES = 8
-- the 1-based index of the cost parameter among p1 .. p5, per kind a chunk may take
local COST_ARG = { tb = 4, gcra = 4, fw = 3, sc = 3, sl = 3, pool = 1 }

local n = #KEYS
local slack, member = lh_int(ARGV[1], 0), ARGV[2]
local min_units, want = lh_int(ARGV[3], 1), lh_int(ARGV[4], 1)
if n < 1 or n > MAX_RULES or #ARGV ~= 4 + 6 * n or slack == nil or member == nil or member == ''
    or min_units == nil or want == nil or want < min_units then
  return lh_invalid()
end

local rules, seen = {}, {}
for i = 1, n do
  local b = 5 + 6 * (i - 1)
  local kind = ARGV[b]
  local alg, at = ALG[kind], COST_ARG[kind]
  if alg == nil or at == nil or seen[KEYS[i]] then
    return lh_invalid()
  end
  seen[KEYS[i]] = true
  local args = { ARGV[b + 1], ARGV[b + 2], ARGV[b + 3], ARGV[b + 4], ARGV[b + 5] }
  local unit = lh_int(args[at], 1)
  if unit == nil or alg.parse(args, 0) == nil then
    return lh_invalid()
  end
  rules[i] = { alg = alg, kind = kind, args = args, at = at, unit = unit, key = KEYS[i] }
end

-- every rule's parameters for a request of k units (nil: k units are beyond a rule's range)
local function params(k)
  local out = {}
  for i = 1, n do
    local r = rules[i]
    local a = { r.args[1], r.args[2], r.args[3], r.args[4], r.args[5] }
    -- the cost as a number: parse reads it as it would read its decimal text (a product up to
    -- 2^40 is exact; any larger one is refused either way)
    a[r.at] = r.unit * k
    out[i] = r.alg.parse(a, 0)
    if out[i] == nil then
      return nil
    end
  end
  return out
end

local now = lh_now()
-- {ok, plans, P} for a request of k units (reads only)
local function check(k)
  local P = params(k)
  if P == nil then
    return { ok = false }
  end
  local plans, ok = {}, true
  for i = 1, n do
    plans[i] = rules[i].alg.check(rules[i].key, P[i], now, member)
    if not plans[i].ok then ok = false end
  end
  return { ok = ok, plans = plans, P = P }
end

local first = check(min_units)
if first.plans == nil then
  return lh_invalid()  -- min units are beyond a rule's range
end
if not first.ok then
  local denied_by, retry, never = 0, 0, false
  for i = 1, n do
    local plan = first.plans[i]
    if not plan.ok then
      if denied_by == 0 then denied_by = i end
      if plan.retry < 0 then never = true else retry = math.max(retry, plan.retry) end
    end
  end
  local reply = { 0, 0, 0, denied_by, never and -1 or retry }
  for i = 1, n do
    local plan = first.plans[i]
    reply[5 + i] = plan.current == nil and plan.remaining or plan.current
  end
  return reply
end

local taken, best = min_units, first
if want > min_units then
  local top = check(want)
  if top.ok then
    taken, best = want, top
  else
    local lo, hi = min_units, want  -- lo admitted, hi denied
    while hi - lo > 1 do
      local mid = math.floor((lo + hi) / 2)
      local got = check(mid)
      if got.ok then lo, best = mid, got else hi = mid end
    end
    taken = lo
  end
end

local valid = -1
local function bound(ms)
  if valid < 0 or ms < valid then valid = ms end
end
for i = 1, n do
  local r, plan = rules[i], best.plans[i]
  r.alg.commit(r.key, best.P[i], plan, now, slack, member)
  if r.kind == 'fw' then
    bound(plan.ms_left)
  elseif r.kind == 'sc' then
    bound(plan.w + best.P[i].window - now)
  elseif r.kind == 'pool' then
    for _, e in ipairs(plan.debits) do bound(e.exp - now) end
  end
end
local reply = { taken, valid, 1, 0, 0 }
for i = 1, n do
  reply[5 + i] = best.plans[i].remaining
end
return reply
