-- token_bucket.lua: one token bucket, millitokens and milliseconds.
-- KEYS[1]  bucket hash {tokens (millitokens), ts (Unix ms)}
-- ARGV[1]  capacity (millitokens)       ARGV[2] refill (millitokens per period)
-- ARGV[3]  period_ms                     ARGV[4] cost (millitokens)
-- ARGV[5]  ttl_slack_ms (>= 0)
-- Reply    {allowed 0/1, remaining_millitokens, retry_after_ms}   retry -1 = can never succeed
-- Rules    integers in [1, 2^40] (slack [0, 2^40]), capacity x period <= 2^52, else the error
--          'ERR rate limit policy arguments invalid' before any read/write; cost > capacity ->
--          {0, 0, -1} untouched; clock = Redis TIME only; backwards clock: no refill and ts never
--          moves back; forward jump clamped to the full-refill time; tokens clamped to a lowered
--          capacity; floor on refill, ceil on retry; a denial writes nothing; every write sets
--          PEXPIRE full_ms + slack (full_ms = ceil(capacity x period / refill)).
-- @include lib/clock.lua
-- @include lib/token_bucket.lua
local P = TB.parse(ARGV, 0)
local slack = lh_int(ARGV[5], 0)
if #ARGV ~= 5 or P == nil or slack == nil then
  return lh_invalid()
end
local now = lh_now()
local plan = TB.check(KEYS[1], P, now)
if plan.ok then
  TB.commit(KEYS[1], P, plan, now, slack)
end
return { plan.ok and 1 or 0, plan.remaining, plan.retry }
