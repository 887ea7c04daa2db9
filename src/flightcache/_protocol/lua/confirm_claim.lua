-- confirm_claim: the claimer of a vacant flight takes its fencing token (INCR owner-seq,
-- which lives in its own slot, so it cannot happen inside join_flight) and becomes owner.
-- Followers need no event for it: every write of the owner carries the token, and only
-- writes under the current token reach the stream.
-- KEYS[1] meta
-- ARGV[1] claim id (from join_flight)   ARGV[2] token   ARGV[3] lease ms
-- Returns 1 the caller owns the flight under the token; 0 its claim lapsed (nothing written)
if redis.call('HGET', KEYS[1], 'claimId') ~= ARGV[1] then
  return 0
end
local token = redis.call('HGET', KEYS[1], 'ownerToken')
if token then
  if token == ARGV[2] then
    return 1  -- this very call, sent again after a lost reply (a driver retry)
  end
  return 0
end
redis.call('HSET', KEYS[1], 'status', 'RUNNING', 'ownerToken', ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return 1
