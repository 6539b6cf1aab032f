-- concurrency_renew.lua: heartbeat for a live concurrency slot.
-- KEYS[1]  sorted set: member = slot id, score = slot expiry (Unix ms)
-- ARGV[1]  slot_id (non-empty)          ARGV[2] slot_ttl_ms (>= 1)
-- Reply    {renewed 0/1, in_flight}   renewed 0 = the slot is gone (expired or released)
-- Rules    validation error reply first; Redis TIME only; the new score is
--          max(old score, now + ttl) (never shortens); a write trims expired slots and sets
--          PEXPIRE (max live score - now); an expired slot is never revived.
-- @include lib/clock.lua
-- @include lib/concurrency.lua
local ttl = lh_int(ARGV[2], 1)
local slot = ARGV[1]
if #ARGV ~= 2 or ttl == nil or slot == nil or slot == '' then
  return lh_invalid()
end
local now = lh_now()
local score = tonumber(redis.call('ZSCORE', KEYS[1], slot))
if score == nil or score <= now then
  return { 0, CC.live(KEYS[1], now) }
end
redis.call('ZADD', KEYS[1], 'XX', math.max(score, now + ttl), slot)
CC.refresh_expiry(KEYS[1], now)
return { 1, CC.live(KEYS[1], now) }
