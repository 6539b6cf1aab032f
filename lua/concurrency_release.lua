-- concurrency_release.lua: end a concurrency slot; idempotent (ZREM).
-- KEYS[1]  sorted set: member = lease id, score = lease expiry (Unix ms)
-- ARGV[1]  lease_id (non-empty)
-- Reply    {released 0/1, in_flight}   released 0 = no such member (already released or trimmed)
-- Rules    Redis TIME only; when a lease was removed the script also trims expired leases and
--          re-sets PEXPIRE (max live score - now); releasing twice changes nothing.
-- @include lib/validate.lua
-- @include lib/clock.lua
-- @include lib/concurrency.lua
local lease = ARGV[1]
if #ARGV ~= 1 or lease == nil or lease == '' then
  return lh_invalid()
end
local now = lh_now()
local removed = redis.call('ZREM', KEYS[1], lease)
if removed == 1 then
  CC.refresh_expiry(KEYS[1], now)
end
return { removed, CC.live(KEYS[1], now) }
