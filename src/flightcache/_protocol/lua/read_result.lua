-- read_result: a stored result with what a near cache and refresh-ahead need.
-- KEYS[1] result   KEYS[2] invalidation marker   KEYS[3] cost (how long it took to compute)
-- Returns {value, ttl_left_ms, marked, cost_ms}: value is nil when nothing is stored;
-- marked is 1 while an invalidation or replacement of this key is under way (serve, do
-- not lease); cost_ms is the loader's run time, or 0 if unknown
local value = redis.call('GET', KEYS[1])
if not value then
  return {false, -2, 0, 0}
end
local cost = tonumber(redis.call('GET', KEYS[3]) or '0') or 0
return {value, redis.call('PTTL', KEYS[1]), redis.call('EXISTS', KEYS[2]), cost}
