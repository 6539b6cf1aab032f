-- lib/clock.lua: the only clock a script uses is the store's own TIME.
-- lh_now(): integer Unix milliseconds = sec * 1000 + floor(usec / 1000).
-- TIME's two replies are strings of decimal digits: arithmetic converts each with the function
-- tonumber uses (the same value), once instead of tonumber's twice.
local function lh_now()
  local t = redis.call('TIME')
  return t[1] * 1000 + math.floor(t[2] / 1000)
end
