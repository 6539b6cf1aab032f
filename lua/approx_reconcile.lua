-- approx_reconcile.lua: one agent's reconciliation of an approximate counter (kernel/approx.py).
-- KEYS[1]  hash {<window index> = units counted in that window} (windows aligned to multiples of their length in Unix time)
-- ARGV[1]  window_ms                     ARGV[2] ttl_slack_ms (>= 0)
-- ARGV[3..] pairs: window index, delta (units this agent admitted in that window since its last
--          reconciliation; 0 = read only), at most 4 pairs; a delta for a window after the current
--          one (the agent's clock ahead of the store's) counts in the current window
-- Reply    {now_ms, count of the current window, count of the previous window}
-- Rules    integers (window [1, 2^40], index [0, 2^50], delta [0, 2^40]) else the error reply before
--          any read or write; a delta for a window older than the previous one is not applied (no
--          decision reads it any more); fields older than the previous window are deleted; every
--          write sets PEXPIRE to the end of the next window + slack; Redis TIME only. Commands:
--          HGETALL, HSET, HDEL, PEXPIRE (the agent's ACL, leasehold/procs.py).
-- @include lib/clock.lua
-- @include lib/validate.lua
local window = lh_int(ARGV[1], 1)
local slack = lh_int(ARGV[2], 0)
local n = #ARGV - 2
if window == nil or slack == nil or n < 0 or n % 2 ~= 0 or n > 8 then
  return lh_invalid()
end
local pairs_ = {}
for i = 3, #ARGV, 2 do
  local idx, delta = lh_int(ARGV[i], 0, LH_MAX_TIME), lh_int(ARGV[i + 1], 0)
  if idx == nil or delta == nil then
    return lh_invalid()
  end
  pairs_[#pairs_ + 1] = { idx, delta }
end
local now = lh_now()
local cur = math.floor(now / window)
local all = redis.call('HGETALL', KEYS[1])
local counts = {}
for i = 1, #all, 2 do
  local w = tonumber(all[i])
  if w == nil or w < cur - 1 then
    redis.call('HDEL', KEYS[1], all[i])
  else
    counts[w] = tonumber(all[i + 1]) or 0
  end
end
local wrote = false
for _, p in ipairs(pairs_) do
  if p[2] > 0 and p[1] >= cur - 1 then
    local w = math.min(p[1], cur)
    counts[w] = (counts[w] or 0) + p[2]
    redis.call('HSET', KEYS[1], string.format('%d', w), string.format('%d', counts[w]))
    wrote = true
  end
end
if wrote then
  redis.call('PEXPIRE', KEYS[1], (cur + 2) * window - now + slack)
end
return { now, counts[cur] or 0, counts[cur - 1] or 0 }
