-- pool_deposit.lua: park a granted global-pool lease in the tenant's pool hash; idempotent.
-- KEYS[1]  pool hash: field = lease id, value = "granted,spent,validFromMs,expiresAtMs,incarnation"
-- ARGV[1]  lease_id (non-empty)          ARGV[2] granted (tokens, [0, 2^40])
-- ARGV[3]  valid_from_ms (absolute Redis-clock Unix ms)
-- ARGV[4]  expires_at_ms (absolute Redis-clock Unix ms, > valid_from_ms)
-- ARGV[5]  max_entries (>= 1)            ARGV[6] ttl_slack_ms (>= 0)
-- Reply    {stored 0/1, status, entries}  status 'stored' | 'replay' (same id already present:
--          nothing changed) | 'full' (max_entries fields already) | 'expired' (expires_at <= now)
-- Rules    validation error reply first; Redis TIME only; the entry records the node's current
--          incarnation (lib/pool.lua: only entries of the current incarnation are spendable);
--          a replay of an entry restored from an older incarnation stays unspendable; the write sets
--          PEXPIRE (max expiresAt over entries - now + slack).
-- @include lib/validate.lua
-- @include lib/clock.lua
-- @include lib/pool.lua
local lease = ARGV[1]
local granted = lh_int(ARGV[2], 0)
local from = lh_int(ARGV[3], 0, LH_MAX_TIME)
local exp = lh_int(ARGV[4], 1, LH_MAX_TIME)
local max_entries = lh_int(ARGV[5], 1)
local slack = lh_int(ARGV[6], 0)
if #ARGV ~= 6 or lease == nil or lease == '' or string.find(lease, ',', 1, true)
    or not (granted and from and exp and max_entries and slack) or exp <= from then
  return lh_invalid()
end
local n = redis.call('HLEN', KEYS[1])
if redis.call('HEXISTS', KEYS[1], lease) == 1 then
  return { 1, 'replay', n }
end
local now = lh_now()
if exp <= now then
  return { 0, 'expired', n }
end
if n >= max_entries then
  return { 0, 'full', n }
end
redis.call('HSET', KEYS[1], lease,
  POOL.encode({ granted = granted, spent = 0, from = from, exp = exp, inc = POOL.incarnation() }))
local top = POOL.max_expiry(POOL.entries(KEYS[1]))
redis.call('PEXPIRE', KEYS[1], math.max(top, exp) - now + slack)
return { 1, 'stored', n + 1 }
