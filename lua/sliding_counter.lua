-- sliding_counter.lua: sliding-window approximate counter, integer arithmetic.
-- KEYS[1]  hash {w (current window start ms), cur, prev}
-- ARGV[1]  limit (units per window)      ARGV[2] window_ms
-- ARGV[3]  cost (units, >= 1)            ARGV[4] ttl_slack_ms (>= 0)
-- Reply    {allowed 0/1, remaining_units, retry_after_ms}   retry -1 = can never succeed
-- Math     scaled = prev x (W - elapsed) + cur x W; allowed iff scaled + cost x W <= limit x W;
--          remaining = floor((limit x W - scaled - cost x W) / W) after admission; deny retry =
--          smallest ms until admitted (decay of prev, else rollover), ceilings throughout.
-- Rules    validation error reply first; cost > limit -> {0, 0, -1} untouched; Redis TIME only;
--          a future stored w is the current window; a denial writes nothing; every write sets
--          PEXPIRE (w + 2W - now) + slack.
-- @include lib/clock.lua
-- @include lib/sliding_counter.lua
local P = SC.parse(ARGV, 0)
local slack = lh_int(ARGV[4], 0)
if #ARGV ~= 4 or P == nil or slack == nil then
  return lh_invalid()
end
local now = lh_now()
local plan = SC.check(KEYS[1], P, now)
if plan.ok then
  SC.commit(KEYS[1], P, plan, now, slack)
end
return { plan.ok and 1 or 0, plan.remaining, plan.retry }
