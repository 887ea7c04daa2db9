-- peek_flight: are the flights followers wait on still running under the claims they know?
-- KEYS[i] meta of flight i   ARGV[i] the stream entry id of the claim followed (its
-- `claimed` event). Several flights a call (their re-checks due together; on a Cluster,
-- one slot a call).
-- Returns, per flight, -1 unless meta holds that very claim and is live: the flight ended
-- (its end deleted meta), lapsed (its lease, or its owner's session), or was claimed again
-- (another `claimed` entry); its follower then joins again to learn which. While it holds:
-- for an unbound flight, the lease it has left in ms; for one bound to its owner's session,
-- {meta's own TTL, owner node, epoch, the session's TTL}: its follower then watches the
-- session (`peek_sessions`) and peeks the flight again only when meta's own TTL ran out.
-- Reads only.
-- include: _live.lua
local out = {}
for i = 1, #KEYS do
  local f = redis.call('HMGET', KEYS[i], 'claimEntry', 'se', 'ownerNode')
  if f[1] ~= ARGV[i] then
    out[i] = -1
  elseif not f[2] then
    out[i] = redis.call('PTTL', KEYS[i])
  else
    local session = session_key(KEYS[i], f[3])
    if redis.call('GET', session) == f[2] then
      out[i] = {redis.call('PTTL', KEYS[i]), f[3], f[2], redis.call('PTTL', session)}
    else
      out[i] = -1
    end
  end
end
return out
