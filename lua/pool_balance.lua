-- pool_balance.lua: read-only view of a pool hash for operators and the lease manager.
-- KEYS[1]  pool hash: field = lease id, value = "granted,spent,validFromMs,expiresAtMs"
-- ARGV     none
-- Reply    {now_ms, {lease_id_1, value_1, lease_id_2, value_2, ...}}  (raw packed values)
-- Rules    reads only; Redis TIME is the clock the values are compared against.
-- @include lib/clock.lua
local now = lh_now()
return { now, redis.call('HGETALL', KEYS[1]) }
