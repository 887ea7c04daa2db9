-- confirm_claim: the claimer of a vacant flight takes its fencing token (INCR owner-seq,
-- which lives in its own slot, so it cannot happen inside join_flight) and becomes owner.
-- KEYS[1] meta   KEYS[2] stream   KEYS[3] waiters
-- ARGV[1] claim id (from join_flight)   ARGV[2] token   ARGV[3] node id   ARGV[4] lease ms
-- ARGV[5] stream TTL ms   ARGV[6] stream MAXLEN
-- Returns 1 the caller owns the flight under the token; 0 its claim lapsed (nothing written)
if redis.call('HGET', KEYS[1], 'claimId') ~= ARGV[1]
    or redis.call('HEXISTS', KEYS[1], 'ownerToken') == 1 then
  return 0
end
local attempts = redis.call('HGET', KEYS[1], 'attempts')
redis.call('HSET', KEYS[1], 'status', 'RUNNING', 'ownerToken', ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[4])
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[6], '*',
  't', 'claimed', 'tok', ARGV[2], 'n', ARGV[3], 'a', attempts)
redis.call('PEXPIRE', KEYS[2], ARGV[5])
redis.call('LREM', KEYS[3], 0, ARGV[3])
return 1
