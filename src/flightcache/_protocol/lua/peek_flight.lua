-- peek_flight: are the flights followers wait on still running under the claims they know?
-- KEYS[i] meta of flight i   ARGV[i] the stream entry id of the claim followed (its
-- `claimed` event). Several flights a call (their re-checks due together; on a Cluster,
-- one slot a call).
-- Returns, per flight, the lease left in ms while meta holds that very claim, else -1: the
-- flight ended (its end deleted meta), lapsed, or was claimed again (another `claimed`
-- entry); its follower then joins again to learn which. Reads only.
local out = {}
for i = 1, #KEYS do
  if redis.call('HGET', KEYS[i], 'claimEntry') == ARGV[i] then
    out[i] = redis.call('PTTL', KEYS[i])
  else
    out[i] = -1
  end
end
return out
