-- renew_leases: the heartbeats of several flights of one owner process, in one call; each
-- extends its lease only while its token is current (renew_lease, batched).
-- KEYS[3i-2] meta   KEYS[3i-1] stream   KEYS[3i] waiters, for each flight i
-- ARGV[3i-2] token   ARGV[3i-1] lease ms   ARGV[3i] stream and waiters TTL ms
-- Returns one number per flight: 1 renewed, 0 the token is no longer the owner's
local out = {}
for i = 1, #KEYS / 3 do
  local meta, stream, waiters = KEYS[3 * i - 2], KEYS[3 * i - 1], KEYS[3 * i]
  if redis.call('HGET', meta, 'ownerToken') == ARGV[3 * i - 2] then
    redis.call('PEXPIRE', meta, ARGV[3 * i - 1])
    redis.call('PEXPIRE', stream, ARGV[3 * i])
    if redis.call('EXISTS', waiters) == 1 then
      redis.call('PEXPIRE', waiters, ARGV[3 * i])
    end
    out[i] = 1
  else
    out[i] = 0
  end
end
return out
