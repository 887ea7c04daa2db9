-- renew_node: a node's liveness lease (the ZooKeeper ephemeral-node idea): heartbeat in,
-- lease out. The server's clock alone decides who is live.
-- KEYS[1] live set (zset: node id -> expiry, server ms)   KEYS[2] node info (hash)
-- ARGV[1] node id   ARGV[2] node TTL ms   ARGV[3] node info (JSON)
-- Expired nodes are removed from both keys. Returns the number of live nodes
local now = redis.call('TIME')
local ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
local gone = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ms)
for _, id in ipairs(gone) do
  redis.call('HDEL', KEYS[2], id)
end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ms)
redis.call('ZADD', KEYS[1], ms + tonumber(ARGV[2]), ARGV[1])
redis.call('HSET', KEYS[2], ARGV[1], ARGV[3])
return redis.call('ZCARD', KEYS[1])
