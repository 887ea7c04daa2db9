-- renew_lease: the owner's heartbeat; extends the lease only while the token is current.
-- KEYS[1] meta   KEYS[2] stream   KEYS[3] waiters
-- ARGV[1] token   ARGV[2] lease ms   ARGV[3] stream and waiters TTL ms
-- Returns 1 renewed, 0 the token is no longer the owner's (taken over, or the lease lapsed)
if redis.call('HGET', KEYS[1], 'ownerToken') ~= ARGV[1] then
  return 0
end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
redis.call('PEXPIRE', KEYS[2], ARGV[3])
if redis.call('EXISTS', KEYS[3]) == 1 then
  redis.call('PEXPIRE', KEYS[3], ARGV[3])
end
return 1
