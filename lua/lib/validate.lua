-- lib/validate.lua: argument validation shared by every script.
-- lh_int(x, min, max): the integer value of ARGV string x if it is a finite integer in
--   [min, max] (max defaults to 2^40), else nil. Comparing a value with itself rejects NaN;
--   the range check rejects +/-inf; x % 1 rejects fractions.
-- lh_invalid(): the one error reply for bad arguments (sent before any read or write).
-- lh_rate_params(a): {capacity, refill, period, cost} from a[1..4] (token bucket and GCRA), each an
--   integer in [1, 2^40] with capacity x period <= 2^52, else nil.
-- lh_window_params(a): {limit, window, cost} from a[1..3] (fixed window, sliding counter, sliding
--   log), each an integer in [1, 2^40] with limit x window <= 2^52, else nil.
-- LH_MAX = 2^40 (largest count / duration), LH_MAX_PRODUCT = 2^52 (largest capacity x period
--   or limit x window, so every product a script forms stays below 2^53 and exact).
local LH_MAX = 2 ^ 40
local LH_MAX_PRODUCT = 2 ^ 52
local LH_MAX_TIME = 2 ^ 50

local function lh_int(x, min, max)
  local v = tonumber(x)
  if v == nil or v ~= v or v < min or v > (max or LH_MAX) or v % 1 ~= 0 then
    return nil
  end
  return v
end

local function lh_invalid()
  return redis.error_reply('ERR rate limit policy arguments invalid')
end

local function lh_rate_params(a)
  local P = { capacity = lh_int(a[1], 1), refill = lh_int(a[2], 1),
              period = lh_int(a[3], 1), cost = lh_int(a[4], 1) }
  if not (P.capacity and P.refill and P.period and P.cost)
      or P.capacity * P.period > LH_MAX_PRODUCT then
    return nil
  end
  return P
end

local function lh_window_params(a)
  local P = { limit = lh_int(a[1], 1), window = lh_int(a[2], 1), cost = lh_int(a[3], 1) }
  if not (P.limit and P.window and P.cost) or P.limit * P.window > LH_MAX_PRODUCT then
    return nil
  end
  return P
end
