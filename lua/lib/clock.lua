-- lib/clock.lua: the only clock a script uses is the store's own TIME.
-- lh_now(): integer Unix milliseconds = sec * 1000 + floor(usec / 1000).
local function lh_now()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
