-- sliding_log.lua: sliding-window log, exact count over (now - W, now].
-- KEYS[1]  sorted set: member = decision id, score = admit time (Unix ms)
-- ARGV[1]  limit (entries per window)    ARGV[2] window_ms
-- ARGV[3]  member (decision id, non-empty; replays are recognised by it)
-- ARGV[4]  cost (entries, 1..1000): cost c is stored as c entries member, member#2 .. member#c
-- ARGV[5]  ttl_slack_ms (>= 0)
-- Reply    {allowed 0/1, remaining_entries, retry_after_ms}   retry -1 = can never succeed
-- Rules    validation error reply first; cost > limit -> {0, 0, -1} untouched; Redis TIME only;
--          a live member is a replay: allowed, nothing added; live count by ZCOUNT, so a denial
--          writes (and trims) nothing; deny retry = k-th oldest live score + W - now with
--          k = live + cost - limit (10,000 ms for 20 entries at t and a 21st at t); writes trim
--          expired members, ZADD, and PEXPIRE (newest score + W - now) + slack.
-- @include lib/clock.lua
-- @include lib/sliding_log.lua
local P = SL.parse({ ARGV[1], ARGV[2], ARGV[4] }, 0)
local slack = lh_int(ARGV[5], 0)
local member = ARGV[3]
if #ARGV ~= 5 or P == nil or slack == nil or member == nil or member == '' then
  return lh_invalid()
end
local now = lh_now()
local plan = SL.check(KEYS[1], P, now, member)
if plan.ok then
  SL.commit(KEYS[1], P, plan, now, slack, member)
end
return { plan.ok and 1 or 0, plan.remaining, plan.retry }
