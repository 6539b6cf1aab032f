-- lib/token_bucket.lua: token bucket in millitokens and milliseconds.
-- State: hash {tokens (millitokens), ts (Unix ms of the last write)}.
-- TB.parse(a, o) -> P or nil (invalid): capacity, refill, period_ms, cost from a[o+1..o+4].
-- TB.check(key, P, now) -> plan {ok, remaining, retry, tokens, ts}; reads only.
-- TB.commit(key, P, plan, now, slack) writes tokens/ts and PEXPIRE full_ms + slack.
-- Deny retry is ceil((cost - tokens) x period / refill): never optimistic while
-- ts <= now, but it ignores the sub-millitoken progress made since ts (may be up to
-- ceil(period / refill) ms late) and, after the clock went back, the time until now reaches ts.
-- An allowing plan also carries `current`: the value before this request's debit (the
-- multi-rule script reports it when another rule denies).
-- @include lib/validate.lua
local TB = {}

function TB.parse(a, o)
  local capacity, refill, period, cost = lh_rate_params(a, o)
  if not capacity then
    return nil
  end
  return { capacity = capacity, refill = refill, period = period, cost = cost,
           full_ms = math.ceil(capacity * period / refill) }
end

function TB.check(key, P, now)
  if P.cost > P.capacity then
    return { ok = false, remaining = 0, retry = -1 }
  end
  local s = redis.call('HMGET', key, 'tokens', 'ts')
  local tokens, ts = tonumber(s[1]), tonumber(s[2])
  if tokens == nil or ts == nil or tokens ~= tokens or ts ~= ts then
    tokens, ts = P.capacity, now
  end
  -- clock backwards: no refill; forward jump: at most one full refill
  local delta = math.min(math.max(0, now - ts), P.full_ms)
  tokens = math.max(0, math.min(P.capacity, tokens))
  tokens = math.min(P.capacity, tokens + math.floor(delta * P.refill / P.period))
  if tokens >= P.cost then
    return { ok = true, remaining = tokens - P.cost, retry = 0, current = tokens,
             tokens = tokens - P.cost, ts = math.max(ts, now) }
  end
  return { ok = false, remaining = tokens,
           retry = math.ceil((P.cost - tokens) * P.period / P.refill) }
end

function TB.commit(key, P, plan, now, slack)
  redis.call('HSET', key, 'tokens', plan.tokens, 'ts', plan.ts)
  redis.call('PEXPIRE', key, P.full_ms + slack)
end
