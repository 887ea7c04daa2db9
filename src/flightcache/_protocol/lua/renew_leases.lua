-- renew_leases: the heartbeats of several flights of one owner process, in one call; each
-- extends its lease only while its token is current (renew_lease, batched).
-- KEYS[3i-2] meta   KEYS[3i-1] stream   KEYS[3i] waiters, for each flight i
-- ARGV[4i-3] token   ARGV[4i-2] lease ms   ARGV[4i-1] stream and waiters TTL ms, or '0'
-- for a short renewal (the lease only: the owner sends a full one often enough that both
-- outlive the lease, docs/protocol.md "Batched renewals")
-- ARGV[4i] claim id ('' where the join took the token itself)
-- Returns one number per flight: 1 renewed, 0 the token is no longer the owner's
-- include: _live.lua
-- include: _fence.lua
local out = {}
for i = 1, #KEYS / 3 do
  local meta, stream, waiters = KEYS[3 * i - 2], KEYS[3 * i - 1], KEYS[3 * i]
  if owns(meta, ARGV[4 * i - 3], ARGV[4 * i]) then
    redis.call('PEXPIRE', meta, ARGV[4 * i - 2])
    local ttl = ARGV[4 * i - 1]
    if ttl ~= '0' then
      redis.call('PEXPIRE', stream, ttl)
      redis.call('PEXPIRE', waiters, ttl)  -- (no follower yet: no key, a no-op)
    end
    out[i] = 1
  else
    out[i] = 0
  end
end
return out
