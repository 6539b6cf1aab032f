-- concurrency_release.lua: end a concurrency slot; idempotent (ZREM).
-- KEYS[1]  sorted set: member = slot id, score = slot expiry (Unix ms)
-- ARGV[1]  slot_id (non-empty)
-- Reply    {released 0/1, in_flight}   released 0 = no such member (already released or trimmed)
-- Rules    Redis TIME only; when a slot was removed the script also trims expired slots and
--          re-sets PEXPIRE (max live score - now); releasing twice changes nothing.
-- @include lib/validate.lua
-- @include lib/clock.lua
-- @include lib/concurrency.lua
local slot = ARGV[1]
if #ARGV ~= 1 or slot == nil or slot == '' then
  return lh_invalid()
end
local now = lh_now()
local removed = redis.call('ZREM', KEYS[1], slot)
if removed == 1 then
  CC.refresh_expiry(KEYS[1], now)
end
return { removed, CC.live(KEYS[1], now) }
