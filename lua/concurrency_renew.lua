-- concurrency_renew.lua: heartbeat for a live concurrency slot.
-- KEYS[1]  sorted set: member = lease id, score = lease expiry (Unix ms)
-- ARGV[1]  lease_id (non-empty)          ARGV[2] lease_ttl_ms (>= 1)
-- Reply    {renewed 0/1, in_flight}   renewed 0 = the lease is gone (expired or released)
-- Rules    validation error reply first; Redis TIME only; the new score is
--          max(old score, now + ttl) (never shortens); a write trims expired leases and sets
--          PEXPIRE (max live score - now); an expired lease is never revived.
-- @include lib/clock.lua
-- @include lib/concurrency.lua
local ttl = lh_int(ARGV[2], 1)
local lease = ARGV[1]
if #ARGV ~= 2 or ttl == nil or lease == nil or lease == '' then
  return lh_invalid()
end
local now = lh_now()
local score = tonumber(redis.call('ZSCORE', KEYS[1], lease))
if score == nil or score <= now then
  return { 0, CC.live(KEYS[1], now) }
end
redis.call('ZADD', KEYS[1], 'XX', math.max(score, now + ttl), lease)
CC.refresh_expiry(KEYS[1], now)
return { 1, CC.live(KEYS[1], now) }
