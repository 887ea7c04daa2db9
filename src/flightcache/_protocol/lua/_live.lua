-- _live.lua: not a script of its own; included (before _fence.lua) by the scripts that ask
-- whether a flight runs (docs/protocol.md, "Sessions"). A meta bound to its owner's session (field
-- `se`, written where the claim carried a live session: one server, never a Cluster) is live
-- only while the owner node's session key holds that epoch; an unbound meta, while it exists
-- (its own lease, as before). The session key is read without being passed in KEYS, which
-- only a server that is not a Cluster allows: no meta on a Cluster has `se`.
local function session_key(meta, node)
  -- meta is '<ns>:meta:{<32 hex digits>}': the namespace is all but its last 40 characters
  return string.sub(meta, 1, -41) .. ':session:' .. node
end
-- live(meta): whether the flight runs; the lease it has left in ms (its session's when
-- bound); `true` when meta is still there though dead (its session lapsed or moved on); and,
-- for a bound flight, its epoch and owner node (a follower watches that session)
local function live(meta)
  local f = redis.call('HMGET', meta, 'se', 'ownerNode')
  if not f[1] then
    local ttl = redis.call('PTTL', meta)
    return ttl ~= -2, ttl, false
  end
  local session = session_key(meta, f[2])
  if redis.call('GET', session) ~= f[1] then
    return false, -2, true
  end
  return true, redis.call('PTTL', session), false, f[1], f[2]
end
