-- peek_flight: are the flights followers wait on still running under the claims they know?
-- KEYS[i] meta of flight i   ARGV[i] the stream entry id of the claim followed (its
-- `claimed` event). Several flights a call (their re-checks due together; on a Cluster,
-- one slot a call).
-- Returns, per flight, the lease left in ms (its owner's session's, for a flight bound to
-- one) while meta holds that very claim and is live, else -1: the flight ended (its end
-- deleted meta), lapsed (its lease, or its owner's session), or was claimed again (another
-- `claimed` entry); its follower then joins again to learn which. Reads only.
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
    out[i] = redis.call('GET', session) == f[2] and redis.call('PTTL', session) or -1
  end
end
return out
