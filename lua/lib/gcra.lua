-- lib/gcra.lua: GCRA in integer milliseconds; same arguments as the token bucket.
-- GCRA.parse(a, o) -> P or nil (invalid): capacity, refill, period_ms, cost from a[o+1..o+4].
-- inc = ceil(cost * period / refill) ms per request, B = floor(capacity * period / refill) ms of
-- burst tolerance. State: string key holding tat (theoretical arrival time, Unix ms).
-- Allowed iff max(tat, now) + inc - now <= B; then tat = max(tat, now) + inc.
-- remaining (millitokens) = floor((B - (tat' - now)) * refill / period), clamped at 0, where tat'
-- is the new tat on allow and max(tat, now) on deny. retry = newTat - now - B.
-- cost > capacity, or inc > B (rounding can make a full-capacity cost unreachable): retry -1.
-- A lowered capacity shrinks B, which clamps the burst on the next call.
-- An allowing plan also carries `current`: the value before this request's debit (the
-- multi-rule script reports it when another rule denies).
-- @include lib/validate.lua
local GCRA = {}

function GCRA.parse(a, o)
  local capacity, refill, period, cost = lh_rate_params(a, o)
  if not capacity then
    return nil
  end
  return { capacity = capacity, refill = refill, period = period, cost = cost,
           inc = math.ceil(cost * period / refill), burst = math.floor(capacity * period / refill) }
end

local function gcra_remaining(P, ahead)
  return math.max(0, math.floor((P.burst - ahead) * P.refill / P.period))
end

function GCRA.check(key, P, now)
  if P.cost > P.capacity or P.inc > P.burst then
    return { ok = false, remaining = 0, retry = -1 }
  end
  local tat = tonumber(redis.call('GET', key))
  if tat == nil or tat ~= tat then
    tat = now
  end
  local start = math.max(tat, now)
  local new_tat = start + P.inc
  if new_tat - now > P.burst then
    return { ok = false, remaining = gcra_remaining(P, start - now),
             retry = new_tat - now - P.burst }
  end
  return { ok = true, remaining = gcra_remaining(P, new_tat - now), retry = 0, tat = new_tat,
           current = gcra_remaining(P, start - now) }
end

function GCRA.commit(key, P, plan, now, slack)
  redis.call('SET', key, plan.tat, 'PX', plan.tat - now + slack)
end
