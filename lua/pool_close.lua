-- pool_close.lua: remove one lease from the pool hash and report what it spent, exactly once.
-- KEYS[1]  pool hash: field = lease id, value = "granted,spent,validFromMs,expiresAtMs,incarnation"
-- ARGV[1]  lease_id (non-empty)
-- Reply    {granted, spent, current} for the removed lease: current 1 when the entry was written
--          in the node's current incarnation (its spent count is exact), 0 when it was restored
--          from an older state (a restart with RDB/AOF, a promoted replica, a migrated slot: debits
--          may be lost, so the caller must count it fully spent); {-1, -1, 0} when absent (already
--          closed, never deposited, or lost with the node's data) or malformed.
-- Rules    HDEL only shrinks the hash; the key keeps the expiry that deposit/spend set (it
--          already covers every remaining entry); an emptied hash disappears.
-- @include lib/validate.lua
-- @include lib/pool.lua
local lease = ARGV[1]
if #ARGV ~= 1 or lease == nil or lease == '' then
  return lh_invalid()
end
local v = redis.call('HGET', KEYS[1], lease)
if not v then
  return { -1, -1, 0 }
end
redis.call('HDEL', KEYS[1], lease)
local e = POOL.decode(v)
if not e then
  return { -1, -1, 0 }
end
return { e.granted, e.spent, POOL.current(e) and 1 or 0 }
