-- end_replace: every holder acknowledged an invalidation: reads may lease again.
-- KEYS[1] invalidation marker   ARGV[1] the invalidation's id
-- Returns 1 if the marker was this invalidation's and is gone, 0 if another one holds it
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
