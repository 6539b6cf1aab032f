-- lib/fixed_window.lua: fixed window. Windows are aligned to multiples of their length in Unix time:
-- w = now - now % window. State: hash {w (window start ms), n (units counted in w)}.
-- A stored w in the future (clock went backwards) is treated as the current window and kept
-- (strict, never generous). Allowed iff n + cost <= limit.
-- remaining = limit - n - cost on allow, max(0, limit - n) on deny; deny retry = ms left in the
-- window; cost > limit -> retry -1. Expiry = ms left in the window + slack.
-- An allowing plan also carries `current`: the value before this request's debit (the
-- multi-rule script reports it when another rule denies).
-- @include lib/validate.lua
local FW = {}

function FW.parse(a, o)
  return lh_window_params(a, o)
end

function FW.check(key, P, now)
  if P.cost > P.limit then
    return { ok = false, remaining = 0, retry = -1 }
  end
  local w = now - (now % P.window)
  local s = redis.call('HMGET', key, 'w', 'n')
  local sw, n = tonumber(s[1]), tonumber(s[2])
  if sw == nil or n == nil or sw ~= sw or n ~= n or sw < w then
    n = 0
  else
    w = sw
  end
  local ms_left = w + P.window - now
  if n + P.cost > P.limit then
    return { ok = false, remaining = math.max(0, P.limit - n), retry = ms_left }
  end
  return { ok = true, remaining = P.limit - n - P.cost, retry = 0, current = P.limit - n,
           w = w, n = n + P.cost, ms_left = ms_left }
end

function FW.commit(key, P, plan, now, slack)
  redis.call('HSET', key, 'w', plan.w, 'n', plan.n)
  redis.call('PEXPIRE', key, plan.ms_left + slack)
end
