-- gcra.lua: GCRA meter in integer milliseconds, same arguments as token_bucket.lua.
-- KEYS[1]  string key: tat (theoretical arrival time, Unix ms)
-- ARGV[1]  capacity (millitokens)       ARGV[2] refill (millitokens per period)
-- ARGV[3]  period_ms                     ARGV[4] cost (millitokens)
-- ARGV[5]  ttl_slack_ms (>= 0)
-- Reply    {allowed 0/1, remaining_millitokens, retry_after_ms}   retry -1 = can never succeed
-- Math     inc = ceil(cost x period / refill), B = floor(capacity x period / refill);
--          allowed iff max(tat, now) + inc - now <= B; retry = newTat - now - B;
--          remaining = floor((B - (tat' - now)) x refill / period) >= 0.
-- Rules    as token_bucket.lua (validation error reply first, cost > capacity or inc > B -> -1
--          untouched, Redis TIME only, a denial writes nothing); the write is
--          SET tat PX (newTat - now + slack).
-- @include lib/clock.lua
-- @include lib/gcra.lua
local P = GCRA.parse(ARGV, 0)
local slack = lh_int(ARGV[5], 0)
if #ARGV ~= 5 or P == nil or slack == nil then
  return lh_invalid()
end
local now = lh_now()
local plan = GCRA.check(KEYS[1], P, now)
if plan.ok then
  GCRA.commit(KEYS[1], P, plan, now, slack)
end
return { plan.ok and 1 or 0, plan.remaining, plan.retry }
