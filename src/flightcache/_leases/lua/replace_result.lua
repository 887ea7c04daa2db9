-- replace_result: start an invalidation (or a replacement) of one key.
-- KEYS[1] result   KEYS[2] invalidation marker   KEYS[3] meta   KEYS[4] cost
-- ARGV[1] invalidation id   ARGV[2] marker TTL ms (the longest lease plus the skew margin)
-- ARGV[3] new encoded value ('' to delete)   ARGV[4] its TTL ms (with ARGV[3])
-- ARGV[5] a fencing token ('' for none): write only while it is the flight's owner token
--         (meta's ownerToken), checked here, in the same call that writes
-- While the marker lives, readers serve without a lease. A flight running now is marked:
-- its result was computed from inputs this call replaces, so it is delivered to its
-- callers but not stored (the memcache-lease rule: a delete invalidates outstanding sets).
-- A write under the flight's own token (ARGV[5]) marks it too: the value set stays, and the
-- flight's result goes to its callers only (no later write overwrites it unannounced).
-- Returns 1 if a result was stored before, or another invalidation of the key is still
-- under way (its holders may still hold the value it removed), else 0; -1 if ARGV[5] is
-- not the owner token (nothing was written)
if ARGV[5] ~= '' and redis.call('HGET', KEYS[3], 'ownerToken') ~= ARGV[5] then
  return -1
end
local busy = redis.call('EXISTS', KEYS[2])
redis.call('SET', KEYS[2], ARGV[1], 'PX', ARGV[2])
if redis.call('EXISTS', KEYS[3]) == 1 then
  redis.call('HSET', KEYS[3], 'invalidated', '1')
end
local existed = math.max(redis.call('EXISTS', KEYS[1]), busy)
redis.call('DEL', KEYS[4])  -- the loader's cost belongs to the value replaced
if ARGV[3] == '' then
  redis.call('DEL', KEYS[1])
else
  redis.call('SET', KEYS[1], ARGV[3], 'PX', ARGV[4])
end
return existed
