-- lib/pool_window.lua: a pool's fallback allowance counted per pool window *as the allocator
-- numbers it* (docs/invariants.md I8). Redis does not know the allocator's clock: the agent passes
-- the window indexes [k_lo, k_hi] its decision may fall in (its offset to the allocator's clock is
-- known within bounds, so near a boundary every candidate window is charged) and the key's TTL.
-- State: hash; field "<k>" = tokens admitted from the allowance in allocator window k; field "x" =
--   the key's expiry (Redis-clock Unix ms, the latest any caller asked for).
-- PW.parse(a, o): limit, k_lo, k_hi, cost, ttl_ms from a[o+1..o+5] (integers; limit, cost, ttl >= 1; k >= 0;
--   0 <= k_hi - k_lo < 8), else nil.
-- PW.check: allowed iff n_k + cost <= limit for every k in [k_lo, k_hi]; cost > limit -> retry -1.
--   remaining = min_k(limit - n_k) - cost on allow, max(0, min_k(limit - n_k)) on deny; a denial's
--   retry is 0 (the window ends on the allocator's clock: the agent supplies the hint).
-- PW.commit: n_k += cost for each candidate k; fields of windows before k_lo - 3 are deleted;
--   PEXPIRE max(x, now + ttl) - now.
-- An allowing plan also carries `current`: the value before this request's debit.
-- @include lib/validate.lua
local PW = { MAX_SPAN = 8, KEEP = 3 }

function PW.parse(a, o)
  local limit, lo, hi, cost, ttl = lh_int(a[o + 1], 1), lh_int(a[o + 2], 0), lh_int(a[o + 3], 0),
      lh_int(a[o + 4], 1), lh_int(a[o + 5], 1)
  if not (limit and lo and hi and cost and ttl) or hi < lo or hi - lo >= PW.MAX_SPAN then
    return nil
  end
  return { limit = limit, lo = lo, hi = hi, cost = cost, ttl = ttl }
end

function PW.check(key, P, now)
  if P.cost > P.limit then
    return { ok = false, remaining = 0, retry = -1 }
  end
  local raw = redis.call('HGETALL', key)
  local state = {}
  for i = 1, #raw, 2 do
    state[raw[i]] = tonumber(raw[i + 1])
  end
  local room = P.limit
  local counts = {}
  for k = P.lo, P.hi do
    local n = state[string.format('%d', k)] or 0
    counts[#counts + 1] = n
    room = math.min(room, P.limit - n)
  end
  if room < P.cost then
    return { ok = false, remaining = math.max(0, room), retry = 0 }
  end
  return { ok = true, remaining = room - P.cost, retry = 0, current = room, counts = counts, state = state }
end

function PW.commit(key, P, plan, now, slack)
  for i, n in ipairs(plan.counts) do
    redis.call('HSET', key, string.format('%d', P.lo + i - 1), n + P.cost)
  end
  for field, _ in pairs(plan.state) do
    local k = tonumber(field)
    if field ~= 'x' and (k == nil or k < P.lo - PW.KEEP) then
      redis.call('HDEL', key, field)
    end
  end
  local until_ms = math.max(plan.state['x'] or 0, now + P.ttl)
  redis.call('HSET', key, 'x', until_ms)
  redis.call('PEXPIRE', key, until_ms - now)
end
