-- lib/sliding_log.lua: sliding-window log. Sorted set: member = decision id,
-- score = admit time ms. Live window (now - W, now]; entries scored after now (clock went
-- backwards) also count (strict). Nothing is trimmed on a denial: the live count is ZCOUNT over
-- the live range; expired members are trimmed only when the script writes.
-- Replay: if `member` is live, the request was already admitted: allowed, nothing written.
-- Weighted cost: a cost c > 1 is stored as c entries `member`, `member#2` .. `member#c`;
-- c is capped at 1,000 (validation error above), so one call adds a bounded number of members.
-- Allowed iff live + cost <= limit. remaining = limit - live - cost on allow (limit - live on
-- replay), max(0, limit - live) on deny. Deny retry = score of the k-th oldest live entry + W -
-- now with k = live + cost - limit (the moment enough entries leave). cost > limit -> retry -1.
-- Expiry = (newest score + W - now) + slack.
-- An allowing plan also carries `current`: the value before this request's debit (the
-- multi-rule script reports it when another rule denies).
-- @include lib/validate.lua
local SL = { needs_member = true }  -- the decision id is the log entry
local SL_MAX_COST = 1000  -- entries one request may add: bounds the script's run time

function SL.parse(a, o)
  local limit, window, cost = lh_int(a[o + 1], 1), lh_int(a[o + 2], 1), lh_int(a[o + 3], 1, SL_MAX_COST)
  if not (limit and window and cost) or limit * window > LH_MAX_PRODUCT then
    return nil
  end
  return { limit = limit, window = window, cost = cost }
end

function SL.check(key, P, now, member)
  if P.cost > P.limit then
    return { ok = false, remaining = 0, retry = -1 }
  end
  local floor_excl = '(' .. string.format('%d', now - P.window)
  local live = redis.call('ZCOUNT', key, floor_excl, '+inf')
  local score = tonumber(redis.call('ZSCORE', key, member))
  if score and score > now - P.window then
    return { ok = true, remaining = math.max(0, P.limit - live), retry = 0, replay = true }
  end
  if live + P.cost > P.limit then
    local k = live + P.cost - P.limit
    local e = redis.call('ZRANGEBYSCORE', key, floor_excl, '+inf', 'WITHSCORES', 'LIMIT', k - 1, 1)
    return { ok = false, remaining = math.max(0, P.limit - live),
             retry = tonumber(e[2]) + P.window - now }
  end
  return { ok = true, remaining = P.limit - live - P.cost, retry = 0, current = P.limit - live }
end

function SL.commit(key, P, plan, now, slack, member)
  if plan.replay then
    return
  end
  redis.call('ZREMRANGEBYSCORE', key, '-inf', now - P.window)
  redis.call('ZADD', key, now, member)
  local batch = {}
  for i = 2, P.cost do
    batch[#batch + 1] = now
    batch[#batch + 1] = member .. '#' .. i
    if #batch >= 200 or i == P.cost then
      redis.call('ZADD', key, unpack(batch))
      batch = {}
    end
  end
  local newest = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')
  local top = math.max(now, tonumber(newest[2]) or now)
  redis.call('PEXPIRE', key, top + P.window - now + slack)
end
