-- _fence.lua: not a script of its own; included (after _live.lua) by every fenced owner
-- write. owns(meta, token, claim): whether `token` holds the flight whose meta is `meta`. A
-- meta bound to a session that lapsed holds nothing (docs/protocol.md, "Sessions"). Where the
-- token was taken with INCR after the join (a Cluster, where owner-seq is in another slot),
-- the claim is confirmed by whichever comes first: confirm_claim, sent beside the loader,
-- or the owner's first fenced write, which carries the claim id as well (so the owner's
-- miss waits for no confirmation: join, INCR, then its writes).
local function owns(meta, token, claim)
  local f = redis.call('HMGET', meta, 'ownerToken', 'claimId', 'se', 'ownerNode')
  if f[3] and redis.call('GET', session_key(meta, f[4])) ~= f[3] then
    return false
  end
  if f[1] then
    return f[1] == token
  end
  if claim ~= '' and f[2] == claim then
    redis.call('HSET', meta, 'ownerToken', token, 'status', 'RUNNING')
    return true
  end
  return false
end
