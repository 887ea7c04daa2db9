-- peek_flight: is the flight a follower waits on still running under the claim it knows?
-- KEYS[1] meta   ARGV[1] the stream entry id of that claim (its `claimed` event)
-- Returns the lease left in ms while meta holds that very claim, else -1: the flight ended
-- (its end deleted meta), lapsed, or was claimed again (another `claimed` entry); the
-- follower then joins again to learn which. Reads only.
if redis.call('HGET', KEYS[1], 'claimEntry') == ARGV[1] then
  return redis.call('PTTL', KEYS[1])
end
return -1
