-- lib/pool.lua: leased global tokens kept in the tenant's hash (one field per lease id).
-- Field value: "granted,spent,validFromMs,expiresAtMs,incarnation" (tokens; Redis-clock Unix ms;
-- incarnation = the node's master_replid when the lease was deposited, lowercase hex).
-- Incarnation: master_replid changes on every start of the server process and on every promotion
--   of a replica (also a master demoted and promoted again), and a slot migrated to another node
--   lands on a node with another one. An entry whose incarnation is not the node's current one
--   was therefore restored from an older state (RDB/AOF after a restart, a lagging replica, a
--   migration) and may have lost debits: it is never spendable, and closing it reports it lost
--   (the agent then counts it fully spent). POOL.incarnation() reads INFO replication once per
--   script run.
-- An entry is spendable while validFrom <= now < expiresAt and its incarnation is current; its
-- balance is granted - spent.
-- POOL.check: spendable = sum of valid balances; allowed iff spendable >= cost; the debit takes
--   the earliest-expiring valid lease first (ties by lease id), splitting across leases.
--   remaining = spendable after the debit (allow) or spendable (deny). Deny retry = earliest
--   validFrom still in the future - now, else 0 (the caller fills in its window-based hint).
--   Malformed entries and entries of another incarnation are ignored (never spendable).
-- POOL.commit: writes the debited entries and extends the key's expiry to max expiresAt - now +
--   slack; it never shortens it (a deposit's slack keeps a lease's record until its agent closes
--   it after the lease's end, whatever slack a later debit passes).
-- POOL.max_expiry(entries): max expiresAt over well-formed entries (or nil).
-- POOL.first_spendable_expiry(entries, now): min expiresAt over spendable entries (or nil).
-- POOL.check_entries(entries, P, now): POOL.check over entries POOL.entries(key) read in this
--   script run; a denying check leaves them unchanged, so a second check may use them again.
-- An allowing plan's `debits` are the debited entries (new spent written), each with `took`: the
-- tokens this check debited from it (pool_take reports them; lua/pool_refund.lua gives them back).
-- An allowing plan also carries `current`: the value before this request's debit (the
-- multi-rule script reports it when another rule denies).
-- @include lib/validate.lua
-- a denial is not stored in a decision record: the agent runs the decision again after a top-up
local POOL = { unrecorded_denial = true }

function POOL.parse(a, o)
  local cost = lh_int(a[o + 1], 1)
  if not cost then
    return nil
  end
  return { cost = cost }
end

function POOL.incarnation()
  if POOL.inc == nil then
    POOL.inc = string.match(redis.call('INFO', 'replication'), 'master_replid:(%x+)') or 'unknown'
  end
  return POOL.inc
end

function POOL.decode(v)
  local g, s, f, e, inc = string.match(v or '', '^(%d+),(%d+),(%d+),(%d+),(%x+)$')
  if not g then
    return nil
  end
  return { granted = tonumber(g), spent = tonumber(s), from = tonumber(f), exp = tonumber(e), inc = inc }
end

function POOL.encode(e)
  return string.format('%d,%d,%d,%d,%s', e.granted, e.spent, e.from, e.exp, e.inc)
end

-- a well-formed entry written in this incarnation of the node
function POOL.current(e)
  return e ~= nil and e.inc == POOL.incarnation()
end

function POOL.entries(key)
  local raw = redis.call('HGETALL', key)
  local out = {}
  for i = 1, #raw, 2 do
    local e = POOL.decode(raw[i + 1])
    if e then
      e.id = raw[i]
      out[#out + 1] = e
    end
  end
  return out
end

function POOL.max_expiry(entries)
  local top = nil
  for _, e in ipairs(entries) do
    if top == nil or e.exp > top then top = e.exp end
  end
  return top
end

-- a spendable entry: current incarnation, valid now, tokens left
function POOL.spendable(e, now)
  return POOL.current(e) and e.from <= now and now < e.exp and e.granted > e.spent
end

function POOL.first_spendable_expiry(entries, now)
  local first = nil
  for _, e in ipairs(entries) do
    if POOL.spendable(e, now) and (first == nil or e.exp < first) then first = e.exp end
  end
  return first
end

function POOL.check(key, P, now)
  return POOL.check_entries(POOL.entries(key), P, now)
end

function POOL.check_entries(entries, P, now)
  local valid, spendable, next_from = {}, 0, nil
  for _, e in ipairs(entries) do
    if not POOL.current(e) then
      -- restored from an older state: never spendable (closed and reported lost by the agent)
    elseif e.from <= now and now < e.exp then
      if e.granted > e.spent then
        valid[#valid + 1] = e
        spendable = spendable + (e.granted - e.spent)
      end
    elseif e.from > now and (next_from == nil or e.from < next_from) then
      next_from = e.from
    end
  end
  if spendable < P.cost then
    return { ok = false, remaining = spendable, retry = next_from and (next_from - now) or 0 }
  end
  table.sort(valid, function(x, y)
    if x.exp ~= y.exp then return x.exp < y.exp end
    return x.id < y.id
  end)
  local left, debits = P.cost, {}
  for _, e in ipairs(valid) do
    if left == 0 then break end
    local take = math.min(left, e.granted - e.spent)
    e.spent = e.spent + take
    e.took = take
    left = left - take
    debits[#debits + 1] = e
  end
  return { ok = true, remaining = spendable - P.cost, retry = 0, current = spendable, debits = debits,
           top = POOL.max_expiry(entries) }
end

function POOL.commit(key, P, plan, now, slack)
  for _, e in ipairs(plan.debits) do
    redis.call('HSET', key, e.id, POOL.encode(e))
  end
  local ttl = plan.top - now + slack
  if redis.call('PTTL', key) < ttl then
    redis.call('PEXPIRE', key, ttl)
  end
end
