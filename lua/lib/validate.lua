-- lib/validate.lua: argument validation shared by every script.
-- lh_int(x, min, max): the integer value of ARGV string x if it is a finite integer in
--   [min, max] (max defaults to 2^40), else nil. Comparing a value with itself rejects NaN;
--   the range check rejects +/-inf; x % 1 rejects fractions.
-- lh_invalid(): the one error reply for bad arguments (sent before any read or write).
-- lh_rate_params(a, o): capacity, refill, period, cost (four values) from a[o+1..o+4] (token bucket
--   and GCRA), each an integer in [1, 2^40] with capacity x period <= 2^52, else nil.
-- lh_window_params(a, o): {limit, window, cost} from a[o+1..o+3] (fixed window, sliding counter),
--   each an integer in [1, 2^40] with limit x window <= 2^52, else nil.
-- A library's parse reads its rule's parameters where they are (ARGV and the rule's offset in it):
--   no table of them is made per call.
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

local function lh_rate_params(a, o)
  local capacity, refill, period, cost = lh_int(a[o + 1], 1), lh_int(a[o + 2], 1), lh_int(a[o + 3], 1),
      lh_int(a[o + 4], 1)
  if not (capacity and refill and period and cost) or capacity * period > LH_MAX_PRODUCT then
    return nil
  end
  return capacity, refill, period, cost
end

local function lh_window_params(a, o)
  local limit, window, cost = lh_int(a[o + 1], 1), lh_int(a[o + 2], 1), lh_int(a[o + 3], 1)
  if not (limit and window and cost) or limit * window > LH_MAX_PRODUCT then
    return nil
  end
  return { limit = limit, window = window, cost = cost }
end
