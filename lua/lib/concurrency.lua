-- lib/concurrency.lua: concurrency cap. Sorted set: member = slot id, score = slot
-- expiry (Unix ms). Live slots: score > now, counted with ZCOUNT (nothing trimmed on denial).
-- CC.check: a live slot with the same id -> acquired again (idempotent), nothing written;
--   else allowed iff live < max_in_flight. The "remaining" slot carries in_flight (live count,
--   after the acquire when allowed). A denial has no time-based retry hint: retry 0 (the caller
--   substitutes its policy Retry-After).
-- CC.commit: trims expired members, ZADD now + lease_ttl, PEXPIRE max live score - now.
-- CC.refresh_expiry(key, now): after a release/renew, trims and re-sets the expiry (or deletes
--   an all-expired key).
-- An allowing plan also carries `current`: the value before this request's debit (the
-- multi-rule script reports it when another rule denies).
-- @include lib/validate.lua
local CC = { needs_member = true }  -- the decision id is the slot id

function CC.parse(a, o)
  local max, ttl = lh_int(a[o + 1], 1), lh_int(a[o + 2], 1)
  if not (max and ttl) then
    return nil
  end
  return { max = max, ttl = ttl }
end

function CC.live(key, now)
  return redis.call('ZCOUNT', key, '(' .. string.format('%d', now), '+inf')
end

function CC.check(key, P, now, member)
  local live = CC.live(key, now)
  local score = tonumber(redis.call('ZSCORE', key, member))
  if score and score > now then
    return { ok = true, remaining = live, retry = 0, replay = true }
  end
  if live >= P.max then
    return { ok = false, remaining = live, retry = 0 }
  end
  return { ok = true, remaining = live + 1, retry = 0, current = live }
end

function CC.refresh_expiry(key, now)
  redis.call('ZREMRANGEBYSCORE', key, '-inf', now)
  local newest = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')
  if newest[2] then
    redis.call('PEXPIRE', key, tonumber(newest[2]) - now)
  end
end

function CC.commit(key, P, plan, now, slack, member)
  if plan.replay then
    return
  end
  redis.call('ZADD', key, now + P.ttl, member)
  CC.refresh_expiry(key, now)
end
