-- concurrency_acquire.lua: take a concurrency slot; idempotent per lease id.
-- KEYS[1]  sorted set: member = lease id, score = lease expiry (Unix ms)
-- ARGV[1]  lease_id (non-empty)          ARGV[2] max_in_flight (>= 1)
-- ARGV[3]  lease_ttl_ms (>= 1)
-- Reply    {acquired 0/1, in_flight}   (in_flight after the acquire when acquired)
-- Rules    validation error reply first; Redis TIME only; live = ZCOUNT (now, +inf]; a live
--          lease with the same id is re-acknowledged without a write; a denial writes (and trims)
--          nothing; a write trims expired leases and sets PEXPIRE (max live score - now).
-- @include lib/clock.lua
-- @include lib/concurrency.lua
local P = CC.parse({ ARGV[2], ARGV[3] })
local lease = ARGV[1]
if #ARGV ~= 3 or P == nil or lease == nil or lease == '' then
  return lh_invalid()
end
local now = lh_now()
local plan = CC.check(KEYS[1], P, now, lease)
if plan.ok then
  CC.commit(KEYS[1], P, plan, now, 0, lease)
end
return { plan.ok and 1 or 0, plan.remaining }
