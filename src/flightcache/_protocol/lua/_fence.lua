-- _fence.lua: not a script of its own; included by every fenced owner write.
-- owns(meta, token, claim): whether `token` holds the flight whose meta is `meta`. Where the
-- token was taken with INCR after the join (a Cluster, where owner-seq is in another slot),
-- the claim is confirmed by whichever comes first: confirm_claim, sent beside the loader,
-- or the owner's first fenced write, which carries the claim id as well (so the owner's
-- miss waits for no confirmation: join, INCR, then its writes).
local function owns(meta, token, claim)
  local current = redis.call('HGET', meta, 'ownerToken')
  if current then
    return current == token
  end
  if claim ~= '' and redis.call('HGET', meta, 'claimId') == claim then
    redis.call('HSET', meta, 'ownerToken', token, 'status', 'RUNNING')
    return true
  end
  return false
end
