-- fail_flight: the owner's fenced report of a failure, or its giving up of the flight.
-- KEYS[1] result   KEYS[2] meta   KEYS[3] stream   KEYS[4] waiters
-- ARGV[1] token   ARGV[2] event type: 'error' (followers raise) or 'reset' (followers
--         may claim at once)   ARGV[3] encoded error record ('' for reset)
-- ARGV[4] negative-cache TTL ms (0: cache nothing; never over a stored value)   ARGV[5] stream linger ms
-- ARGV[6] wake channel prefix   ARGV[7] digest   ARGV[8] wake message limit (bytes)
-- ARGV[9] claim id ('' where the join took the token itself)
-- Returns 1 published, 0 fenced: the token is not the current owner's, nothing was written
-- include: _wake.lua
-- include: _live.lua
-- include: _fence.lua
if not owns(KEYS[2], ARGV[1], ARGV[9] or '') then
  return 0
end
if tonumber(ARGV[4]) > 0 then
  -- NX: an error never replaces a stored value (a failed refresh leaves the old one)
  redis.call('SET', KEYS[1], ARGV[3], 'PX', ARGV[4], 'NX')
end
local w = wake_start(KEYS[4], KEYS[3])
local event = {'t', ARGV[2], 'tok', ARGV[1], 'v', ARGV[3]}
wake_add(w, redis.call('XADD', KEYS[3], '*', unpack(event)), event)
wake_send(w, ARGV[6], ARGV[7], ARGV[8])
redis.call('PEXPIRE', KEYS[3], ARGV[5])
redis.call('DEL', KEYS[2])
if ARGV[2] == 'error' then
  redis.call('DEL', KEYS[4])  -- the flight is over; after a reset the queue decides who claims
end
return 1
