-- concurrency_acquire.lua: take a concurrency slot; idempotent per slot id.
-- KEYS[1]  sorted set: member = slot id, score = slot expiry (Unix ms)
-- ARGV[1]  slot_id (non-empty)          ARGV[2] max_in_flight (>= 1)
-- ARGV[3]  slot_ttl_ms (>= 1)
-- Reply    {acquired 0/1, in_flight}   (in_flight after the acquire when acquired)
-- Rules    validation error reply first; Redis TIME only; live = ZCOUNT (now, +inf]; a live
--          slot with the same id is re-acknowledged without a write; a denial writes (and trims)
--          nothing; a write trims expired slots and sets PEXPIRE (max live score - now).
-- @include lib/clock.lua
-- @include lib/concurrency.lua
local P = CC.parse(ARGV, 1)
local slot = ARGV[1]
if #ARGV ~= 3 or P == nil or slot == nil or slot == '' then
  return lh_invalid()
end
local now = lh_now()
local plan = CC.check(KEYS[1], P, now, slot)
if plan.ok then
  CC.commit(KEYS[1], P, plan, now, 0, slot)
end
return { plan.ok and 1 or 0, plan.remaining }
