-- read_result: a stored result with what a near cache needs to lease it.
-- KEYS[1] result   KEYS[2] invalidation marker
-- Returns {value, ttl_left_ms, marked}: value is nil when nothing is stored; marked is 1
-- while an invalidation or replacement of this key is under way (serve, do not lease)
local value = redis.call('GET', KEYS[1])
if not value then
  return {false, -2, 0}
end
return {value, redis.call('PTTL', KEYS[1]), redis.call('EXISTS', KEYS[2])}
