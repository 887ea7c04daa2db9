-- join_flight: one round trip that says what a caller of a flight should do.
-- KEYS[1] result   KEYS[2] meta   KEYS[3] waiters   KEYS[4] stream
-- ARGV[1] node id of the caller   ARGV[2] waiters TTL in ms
-- Returns {1, value}                        hit: the stored value (or error record)
--         {2, token, lease_left_ms, rank, last_id}
--                                           follow: a flight is RUNNING; the caller is now
--                                           registered in waiters at 0-based position `rank`;
--                                           every event of this owner's end comes after
--                                           `last_id`, the stream's newest entry now
--         {0, rank}                         vacant: no result, no live owner; rank is the
--                                           caller's position in waiters, or -1
local value = redis.call('GET', KEYS[1])
if value then
  return {1, value}
end
local rank = redis.call('LPOS', KEYS[3], ARGV[1])
local token = redis.call('HGET', KEYS[2], 'ownerToken')
if token then
  if not rank then
    rank = redis.call('RPUSH', KEYS[3], ARGV[1]) - 1
  end
  redis.call('PEXPIRE', KEYS[3], ARGV[2])
  local last = redis.call('XREVRANGE', KEYS[4], '+', '-', 'COUNT', 1)
  return {2, token, redis.call('PTTL', KEYS[2]), rank, last[1] and last[1][1] or '0-0'}
end
return {0, rank or -1}
