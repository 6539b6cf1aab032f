-- pool_close.lua: remove one lease from the pool hash and report what it spent, exactly once.
-- KEYS[1]  pool hash: field = lease id, value = "granted,spent,validFromMs,expiresAtMs"
-- ARGV[1]  lease_id (non-empty)
-- Reply    {granted, spent} for the removed lease, or {-1, -1} when absent (already closed).
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
  return { -1, -1 }
end
redis.call('HDEL', KEYS[1], lease)
local e = POOL.decode(v)
if not e then
  return { -1, -1 }
end
return { e.granted, e.spent }
