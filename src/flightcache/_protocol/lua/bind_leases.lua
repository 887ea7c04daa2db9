-- bind_leases: an owner's renewal of flights claimed before its session was up that also
-- binds each one to that session (docs/protocol.md, "Binding a flight after its claim").
-- KEYS[3i-2] meta   KEYS[3i-1] stream   KEYS[3i] waiters, for each flight i
-- ARGV[1] the session's epoch   ARGV[2] the backstop ms (a bound flight's own keys' TTL)
-- ARGV[4i-1] token   ARGV[4i] lease ms   ARGV[4i+1] stream and waiters TTL ms
-- ARGV[4i+2] claim id ('' where the join took the token itself)
-- Returns one number per flight: 2 bound (its meta, stream and waiters now live for the
-- backstop, its liveness is the session's); 1 renewed unbound, as renew_leases would (the
-- owner's session key does not hold the epoch: its session lapsed or moved on); 0 the token
-- is no longer the owner's
-- include: _live.lua
-- include: _fence.lua
local epoch, backstop = ARGV[1], ARGV[2]
local holds = {}  -- session key -> whether it holds the epoch (one read a key)
local out = {}
for i = 1, #KEYS / 3 do
  local meta, stream, waiters = KEYS[3 * i - 2], KEYS[3 * i - 1], KEYS[3 * i]
  local token, lease, ttl, claim = ARGV[4 * i - 1], ARGV[4 * i], ARGV[4 * i + 1], ARGV[4 * i + 2]
  if owns(meta, token, claim) then
    -- the session of the node that claimed it (this owner's: its token holds)
    local session = session_key(meta, redis.call('HGET', meta, 'ownerNode'))
    if holds[session] == nil then
      holds[session] = redis.call('GET', session) == epoch
    end
    if holds[session] then
      redis.call('HSET', meta, 'se', epoch)
      lease, ttl = backstop, backstop
      out[i] = 2
    else
      out[i] = 1
    end
    redis.call('PEXPIRE', meta, lease)
    redis.call('PEXPIRE', stream, ttl)
    redis.call('PEXPIRE', waiters, ttl)  -- (no follower yet: no key, a no-op)
  else
    out[i] = 0
  end
end
return out
