-- pool_take.lua: buy an in-process chunk from a pool balance: at least
-- min and at most want tokens, from the earliest-expiring valid leases first (lib/pool.lua).
-- KEYS[1]  pool hash: field = lease id, value = "granted,spent,validFromMs,expiresAtMs,incarnation"
-- ARGV[1]  min (tokens, >= 1)      ARGV[2] want (tokens, >= min)      ARGV[3] ttl_slack_ms (>= 0)
-- ARGV[4]  per_s (optional, tokens, >= 0; 0 or absent: no cap): the chunk holds at most
--          ceil(per_s x life / 1000) tokens, life = ms until the earliest-expiring spendable lease
--          ends (the chunk's validity ends with it), and never fewer than min: a chunk taken from a
--          lease about to end holds only what its holder can spend before then (the rest would
--          expire in the chunk; left in the lease it is reported unspent and returned to the pool)
-- ARGV[5]  waiting (optional, with ARGV[4], tokens, >= 0): the per_s cap never goes below it either:
--          the tokens of the requests waiting for this chunk are spent at once, however soon the lease
--          ends (capped below them, a burst in a lease's last moments needed one renewal per request)
-- Reply    {taken, remaining, valid_for_ms, next_from_ms, debits}
--          taken: tokens debited, min(want, spendable); 0 when fewer than min are spendable
--            (nothing written);
--          remaining: spendable after the take;
--          valid_for_ms: min over the debited leases of expiresAt - now (0 when nothing taken): the
--            chunk must not outlive a lease it was bought from, and every lease ends no later than
--            its window, so a chunk never carries tokens of window k into k+1 — whichever agent of
--            the region deposited the lease;
--          next_from_ms: ms until the earliest not-yet-valid lease becomes valid (0: none);
--          debits: {lease_id_1, tokens_1, lease_id_2, tokens_2, ...}, what the take debited from each
--            lease, in debit order (earliest-expiring first), tokens >= 1 summing to taken ({} when
--            nothing taken): the caller's limit per lease for a later lua/pool_refund.lua of the
--            chunk's unspent rest.
-- Rules    validation error reply first; Redis TIME only; only leases of the node's current
--          incarnation are spendable; the debit extends the key's expiry to max expiresAt - now +
--          slack, never shortens it.
-- @include lib/validate.lua
-- @include lib/clock.lua
-- @include lib/pool.lua
local min, want, slack = lh_int(ARGV[1], 1), lh_int(ARGV[2], 1), lh_int(ARGV[3], 0)
local per_s, waiting = 0, 0
if #ARGV >= 4 then
  per_s = lh_int(ARGV[4], 0)
end
if #ARGV == 5 then
  waiting = lh_int(ARGV[5], 0)
end
if (#ARGV < 3 or #ARGV > 5) or not (min and want and slack and per_s and waiting) or want < min then
  return lh_invalid()
end
local now = lh_now()
local entries = POOL.entries(KEYS[1])
if per_s > 0 then
  local first = POOL.first_spendable_expiry(entries, now)
  if first ~= nil then
    local cap = math.max(waiting, math.floor((per_s * (first - now) + 999) / 1000))
    want = math.max(min, math.min(want, cap))
  end
end
local plan = POOL.check_entries(entries, { cost = want }, now)
if not plan.ok and plan.remaining >= min then
  plan = POOL.check_entries(entries, { cost = plan.remaining }, now)
end
if not plan.ok then
  return { 0, plan.remaining, 0, plan.retry, {} }
end
POOL.commit(KEYS[1], nil, plan, now, slack)
local until_ms, debits = nil, {}
for _, e in ipairs(plan.debits) do
  if until_ms == nil or e.exp < until_ms then until_ms = e.exp end
  debits[#debits + 1] = e.id
  debits[#debits + 1] = e.took
end
return { plan.current - plan.remaining, plan.remaining, until_ms - now, 0, debits }
