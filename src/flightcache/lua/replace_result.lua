-- replace_result: start an invalidation (or a replacement) of one key.
-- KEYS[1] result   KEYS[2] invalidation marker
-- ARGV[1] invalidation id   ARGV[2] marker TTL ms (the longest lease plus the skew margin)
-- ARGV[3] new encoded value ('' to delete)   ARGV[4] its TTL ms (with ARGV[3])
-- While the marker lives, readers serve without a lease and flights deliver their result
-- without storing it (a value computed before the invalidation must not outlive it).
-- Returns 1 if a result was stored before, else 0
redis.call('SET', KEYS[2], ARGV[1], 'PX', ARGV[2])
local existed = redis.call('EXISTS', KEYS[1])
if ARGV[3] == '' then
  redis.call('DEL', KEYS[1])
else
  redis.call('SET', KEYS[1], ARGV[3], 'PX', ARGV[4])
end
return existed
