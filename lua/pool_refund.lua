-- pool_refund.lua: give back the unspent rest of an in-process chunk part to the leases it was
-- bought from (lua/pool_take.lua's debits), at most once per refund id.
-- KEYS[1]  pool hash: field = lease id, value = "granted,spent,validFromMs,expiresAtMs,incarnation"
-- KEYS[2]  refund record (same hash tag; its name is the refund id: one per chunk part, unique per
--          agent process): present = this refund already ran; value = the tokens it gave back
-- ARGV[1]  tokens (>= 1): the part's unspent rest, already removed from the part (never spent locally)
-- ARGV[2]  slack_ms (>= 0): the balance's record slack (a lease is closed after its end, on a tick)
-- ARGV[3..] lease_id, debited pairs (1 to 16 pairs, distinct non-empty ids, debited >= 1): what the
--          part's pool_take debited from each lease
-- Reply    {refunded, status}  status 'refunded' (this call ran; refunded may be 0) | 'replay' (the
--          record was present: nothing changed, refunded = what the first call gave back)
-- Rules    validation error reply first; Redis TIME only. A named lease is lowered only if its entry
--          is present (not closed), well-formed, of the node's current incarnation (lib/pool.lua: a
--          restored entry may have lost the debit), not more than slack_ms past its end, and its
--          spent >= debited (the debit is still in it); it is lowered by at most its debited count,
--          latest-expiring lease first (ties by lease id), in total at most tokens: spent never goes
--          below what other debits put there, and never below 0.
--          Exactly once: the record is written with the refund, in the same script, and lives at
--          least max(expiresAt of the named entries) + slack_ms - now and at least the pool hash's
--          remaining life; a replay while it lives changes nothing, and a replay after it is gone
--          finds every named entry either absent or more than slack_ms past its end, so it changes
--          nothing either. Lowering spent twice would let the region spend tokens that were
--          admitted (over-admission): the record is the safety of this script.
--          The write extends the pool hash's expiry to max expiresAt - now + slack, never shortens it.
-- @include lib/validate.lua
-- @include lib/clock.lua
-- @include lib/pool.lua
local tokens, slack = lh_int(ARGV[1], 1), lh_int(ARGV[2], 0)
local n = (#ARGV - 2) / 2
if not (tokens and slack) or n < 1 or n > 16 or n % 1 ~= 0 then
  return lh_invalid()
end
local caps, named = {}, {}
for i = 0, n - 1 do
  local lease, cap = ARGV[3 + 2 * i], lh_int(ARGV[4 + 2 * i], 1)
  if lease == nil or lease == '' or not cap or caps[lease] ~= nil then
    return lh_invalid()
  end
  caps[lease] = cap
  named[#named + 1] = lease
end
local done = redis.call('GET', KEYS[2])
if done then
  return { tonumber(done) or 0, 'replay' }
end
local now = lh_now()
local eligible, last = {}, nil
for _, lease in ipairs(named) do
  local e = POOL.decode(redis.call('HGET', KEYS[1], lease))
  if e then
    e.id = lease
    if last == nil or e.exp > last then last = e.exp end
    if POOL.current(e) and now < e.exp + slack and e.spent >= caps[lease] then
      eligible[#eligible + 1] = e
    end
  end
end
table.sort(eligible, function(x, y)
  if x.exp ~= y.exp then return x.exp > y.exp end
  return x.id < y.id
end)
local left = tokens
for _, e in ipairs(eligible) do
  if left == 0 then break end
  local give = math.min(left, caps[e.id])
  e.spent = e.spent - give
  left = left - give
  redis.call('HSET', KEYS[1], e.id, POOL.encode(e))
end
local refunded = tokens - left
local ttl = math.max(redis.call('PTTL', KEYS[1]), slack, 1)
if last ~= nil then
  ttl = math.max(ttl, last - now + slack)
end
redis.call('SET', KEYS[2], refunded, 'PX', ttl)
if refunded > 0 then
  local top = POOL.max_expiry(POOL.entries(KEYS[1]))
  if top ~= nil and redis.call('PTTL', KEYS[1]) < top - now + slack then
    redis.call('PEXPIRE', KEYS[1], top - now + slack)
  end
end
return { refunded, 'refunded' }
