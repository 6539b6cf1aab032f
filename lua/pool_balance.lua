-- pool_balance.lua: read-only view of a pool hash for operators and the lease manager.
-- KEYS[1]  pool hash: field = lease id, value = "granted,spent,validFromMs,expiresAtMs,incarnation"
-- ARGV     none
-- Reply    {now_ms, {lease_id_1, value_1, lease_id_2, value_2, ...}, incarnation}  (raw packed
--          values; incarnation = the node's current one: only entries carrying it are spendable)
-- Rules    reads only; Redis TIME is the clock the values are compared against.
-- @include lib/clock.lua
-- @include lib/pool.lua
local now = lh_now()
return { now, redis.call('HGETALL', KEYS[1]), POOL.incarnation() }
