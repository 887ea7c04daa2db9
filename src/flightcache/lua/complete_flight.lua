-- complete_flight: the owner's fenced write of the result.
-- KEYS[1] result   KEYS[2] meta   KEYS[3] stream   KEYS[4] waiters
-- ARGV[1] token   ARGV[2] encoded value   ARGV[3] result TTL ms (jitter applied)
-- ARGV[4] '1' to carry the value inside the done event, '0' not to
-- ARGV[5] how long the stream lingers after the flight, ms   ARGV[6] stream MAXLEN
-- Returns 1 written, 0 fenced: the token is not the current owner's, nothing was written
if redis.call('HGET', KEYS[2], 'ownerToken') ~= ARGV[1] then
  return 0
end
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
if ARGV[4] == '1' then
  redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[6], '*', 't', 'done', 'tok', ARGV[1], 'v', ARGV[2])
else
  redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[6], '*', 't', 'done', 'tok', ARGV[1])
end
redis.call('PEXPIRE', KEYS[3], ARGV[5])
redis.call('DEL', KEYS[2], KEYS[4])
return 1
