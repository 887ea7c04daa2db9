-- renew_session: a node's session on this server, the liveness of every flight it claimed
-- bound to it (docs/protocol.md, "Sessions").
-- KEYS[1] the node's session key   ARGV[1] the session's epoch   ARGV[2] lease ms
-- ARGV[3] '1' to start the session (a fresh epoch, which no claim carries yet: it replaces
-- any older epoch of this node, whose flights are dead from then on), '0' to renew it
-- Returns 1 the session holds this epoch for a lease from now, 0 it does not (it lapsed or
-- was replaced): a renewal never brings a lapsed session back.
if ARGV[3] == '1' then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 1
end
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
