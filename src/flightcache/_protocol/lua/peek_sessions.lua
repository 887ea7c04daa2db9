-- peek_sessions: do the sessions that followed flights are bound to still hold their epochs?
-- (docs/protocol.md, "Followers watch sessions"). One server only: no Cluster has sessions.
-- KEYS[i] a node's session key   ARGV[i] the epoch the followed flights are bound to
-- Returns, per session, the ms its key has left while it holds that epoch, else -1 (lapsed,
-- or replaced by a newer epoch: every flight bound to that epoch is dead, for good).
-- Reads only.
local out = {}
for i = 1, #KEYS do
  if redis.call('GET', KEYS[i]) == ARGV[i] then
    out[i] = redis.call('PTTL', KEYS[i])
  else
    out[i] = -1
  end
end
return out
