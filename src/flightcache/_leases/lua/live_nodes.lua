-- live_nodes: the nodes whose liveness lease holds now, by the server's clock; members of
-- the node set whose lease key has expired are removed, in the same atomic call, so a node
-- renewing at that moment cannot be dropped (its renewal re-adds it when its key was gone).
-- KEYS[1] node set   KEYS[2...] the lease key of each member (<ns>:node:{<ns>}:<id>), in
-- the order of ARGV[2...]
-- ARGV[1] node id leaving ('' for none): its key is deleted and it leaves the set first
-- ARGV[2...] the node ids, as SMEMBERS listed them
-- Returns {id, info, ttl_left_ms, id, info, ttl_left_ms, ...}
local out = {}
for i = 2, #KEYS do
  local id = ARGV[i]
  local info = false
  if id == ARGV[1] then
    redis.call('DEL', KEYS[i])
  else
    info = redis.call('GET', KEYS[i])
  end
  if info then
    table.insert(out, id)
    table.insert(out, info)
    table.insert(out, redis.call('PTTL', KEYS[i]))
  else
    redis.call('SREM', KEYS[1], id)
  end
end
return out
