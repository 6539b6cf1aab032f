-- fixed_window.lua: fixed window counter, windows aligned to multiples of their length in Unix time.
-- KEYS[1]  hash {w (window start, Unix ms), n (units admitted in w)}
-- ARGV[1]  limit (units per window)      ARGV[2] window_ms
-- ARGV[3]  cost (units, >= 1)            ARGV[4] ttl_slack_ms (>= 0)
-- Reply    {allowed 0/1, remaining_units, retry_after_ms}   retry -1 = can never succeed
-- Rules    integers in [1, 2^40] (slack [0, 2^40]), limit x window <= 2^52, else the error reply
--          before any read/write; cost > limit -> {0, 0, -1} untouched; Redis TIME only; a stored
--          w in the future is treated as the current window (strict); denial retry = ms left in
--          the window and writes nothing; every write sets PEXPIRE ms_left + slack.
-- @include lib/clock.lua
-- @include lib/fixed_window.lua
local P = FW.parse(ARGV, 0)
local slack = lh_int(ARGV[4], 0)
if #ARGV ~= 4 or P == nil or slack == nil then
  return lh_invalid()
end
local now = lh_now()
local plan = FW.check(KEYS[1], P, now)
if plan.ok then
  FW.commit(KEYS[1], P, plan, now, slack)
end
return { plan.ok and 1 or 0, plan.remaining, plan.retry }
