-- concurrency_release.lua: end a concurrency slot; idempotent (ZREM).
-- KEYS[1]  sorted set: member = slot id, score = slot expiry (Unix ms)
-- ARGV[1]  slot_id (non-empty)
-- Reply    {released 0/1, in_flight}   released 1 = a live slot was freed; 0 = none was (no such
--          member: never acquired, already released or trimmed; or its slot had expired)
-- Rules    Redis TIME only; when a member was removed (live or expired) the script also trims
--          expired slots and re-sets PEXPIRE (max live score - now); releasing twice changes nothing.
-- @include lib/validate.lua
-- @include lib/clock.lua
-- @include lib/concurrency.lua
local slot = ARGV[1]
if #ARGV ~= 1 or slot == nil or slot == '' then
  return lh_invalid()
end
local now = lh_now()
local score = tonumber(redis.call('ZSCORE', KEYS[1], slot))
if score == nil then
  return { 0, CC.live(KEYS[1], now) }
end
redis.call('ZREM', KEYS[1], slot)
CC.refresh_expiry(KEYS[1], now)
return { score > now and 1 or 0, CC.live(KEYS[1], now) }
