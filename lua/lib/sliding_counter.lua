-- lib/sliding_counter.lua: sliding-window approximate counter, integer arithmetic.
-- State: hash {w (current window start ms), cur, prev}. Windows aligned: w = now - now % W.
-- Roll forward from the stored w: same or future window -> keep (a future w stays the current
-- window, elapsed 0: strict); 0 < w - sw < 2W -> prev = cur, cur = 0; otherwise both 0.
-- Stored counts are clamped to the current limit (a lowered limit keeps products <= 2^53).
-- scaled = prev * (W - elapsed) + cur * W; allowed iff scaled + cost * W <= limit * W.
-- remaining = floor((limit*W - scaled - cost*W) / W) on allow, max(0, floor((limit*W - scaled)/W))
-- on deny. Deny retry = the smallest whole ms after which the same request would be admitted
-- (decay of prev inside this window, else the rollover into the next one), using ceilings.
-- cost > limit -> retry -1. Expiry = end of the next window (w + 2W - now) + slack.
-- An allowing plan also carries `current`: the value before this request's debit (the
-- multi-rule script reports it when another rule denies).
-- @include lib/validate.lua
local SC = {}

function SC.parse(a, o)
  return lh_window_params(a, o)
end

local function sc_retry(P, ew, now, elapsed, prev, cur, scaled)
  local W = P.window
  local excess = scaled + P.cost * W - P.limit * W
  local lag = math.max(0, ew - now)
  if prev > 0 then
    local k = math.ceil(excess / prev)
    if elapsed + k < W then
      return lag + k
    end
  end
  local t0 = ew + W - now
  local ex2 = cur * W + P.cost * W - P.limit * W
  if ex2 <= 0 then
    return t0
  end
  return t0 + math.min(math.ceil(ex2 / cur), W)
end

function SC.check(key, P, now)
  if P.cost > P.limit then
    return { ok = false, remaining = 0, retry = -1 }
  end
  local W = P.window
  local w = now - (now % W)
  local s = redis.call('HMGET', key, 'w', 'cur', 'prev')
  local sw, cur, prev = tonumber(s[1]), tonumber(s[2]) or 0, tonumber(s[3]) or 0
  if sw == nil or sw ~= sw or cur ~= cur or prev ~= prev then
    cur, prev = 0, 0
  elseif sw >= w then
    w = sw
  elseif w - sw < 2 * W then
    prev, cur = cur, 0
  else
    cur, prev = 0, 0
  end
  cur = math.max(0, math.min(cur, P.limit))
  prev = math.max(0, math.min(prev, P.limit))
  local elapsed = math.max(0, now - w)
  local scaled = prev * (W - elapsed) + cur * W
  local cap = P.limit * W
  if scaled + P.cost * W > cap then
    return { ok = false, remaining = math.max(0, math.floor((cap - scaled) / W)),
             retry = sc_retry(P, w, now, elapsed, prev, cur, scaled) }
  end
  return { ok = true, remaining = math.floor((cap - scaled - P.cost * W) / W), retry = 0,
           current = math.floor((cap - scaled) / W),
           w = w, cur = cur + P.cost, prev = prev }
end

function SC.commit(key, P, plan, now, slack)
  redis.call('HSET', key, 'w', plan.w, 'cur', plan.cur, 'prev', plan.prev)
  redis.call('PEXPIRE', key, plan.w + 2 * P.window - now + slack)
end
