-- live_nodes: the nodes whose liveness lease holds now, by the server's clock.
-- KEYS[1] live set (zset)   KEYS[2] node info (hash)
-- ARGV[1] node id to remove first ('' for none: a node leaving on close)
-- Returns {id, info, ttl_left_ms, id, info, ttl_left_ms, ...}
if ARGV[1] ~= '' then
  redis.call('ZREM', KEYS[1], ARGV[1])
  redis.call('HDEL', KEYS[2], ARGV[1])
end
local now = redis.call('TIME')
local ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
local live = redis.call('ZRANGEBYSCORE', KEYS[1], '(' .. ms, '+inf', 'WITHSCORES')
local out = {}
for i = 1, #live, 2 do
  table.insert(out, live[i])
  table.insert(out, redis.call('HGET', KEYS[2], live[i]) or '{}')
  table.insert(out, tonumber(live[i + 1]) - ms)
end
return out
