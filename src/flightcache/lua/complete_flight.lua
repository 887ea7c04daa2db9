-- complete_flight: the owner's fenced write of the result.
-- KEYS[1] result   KEYS[2] meta   KEYS[3] stream   KEYS[4] waiters
-- ARGV[1] token   ARGV[2] encoded value   ARGV[3] result TTL ms (jitter applied)
-- ARGV[4] '1' to carry the value inside the done event, '0' not to
-- ARGV[5] how long the stream lingers after the flight, ms
-- ARGV[6] chunk count of a stream flight ('' for a value), carried in the done event so a
--         follower knows it saw every chunk
-- Returns 1 written, 0 fenced: the token is not the current owner's, nothing was written
if redis.call('HGET', KEYS[2], 'ownerToken') ~= ARGV[1] then
  return 0
end
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
local event = {'t', 'done', 'tok', ARGV[1]}
if ARGV[4] == '1' then
  table.insert(event, 'v')
  table.insert(event, ARGV[2])
end
if ARGV[6] ~= '' then
  table.insert(event, 'n')
  table.insert(event, ARGV[6])
end
redis.call('XADD', KEYS[3], '*', unpack(event))
redis.call('PEXPIRE', KEYS[3], ARGV[5])
redis.call('DEL', KEYS[2], KEYS[4])
return 1
