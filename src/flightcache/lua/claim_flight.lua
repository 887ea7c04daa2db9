-- claim_flight: compare-and-set claim of a flight with a fresh fencing token.
-- KEYS[1] result   KEYS[2] meta   KEYS[3] stream   KEYS[4] waiters
-- ARGV[1] token (from INCR owner-seq)   ARGV[2] node id   ARGV[3] lease ms
-- ARGV[4] loader timeout ms   ARGV[5] stream TTL ms   ARGV[6] key description
-- ARGV[7] stream MAXLEN
-- Returns {1, value}                        a result exists: the claim is a hit
--         {2, token, lease_left_ms, rank, last_id}
--                                           another owner holds the flight: follow it (as in
--                                           join_flight)
--         {0, attempts}                     claimed: the caller is the owner
local value = redis.call('GET', KEYS[1])
if value then
  return {1, value}
end
local current = redis.call('HGET', KEYS[2], 'ownerToken')
if current then
  local rank = redis.call('LPOS', KEYS[4], ARGV[2])
  if not rank then
    rank = redis.call('RPUSH', KEYS[4], ARGV[2]) - 1
  end
  local newest = redis.call('XREVRANGE', KEYS[3], '+', '-', 'COUNT', 1)
  return {2, current, redis.call('PTTL', KEYS[2]), rank, newest[1] and newest[1][1] or '0-0'}
end
-- The flight is vacant. If the newest event is a claim, its owner died mid-flight:
-- this claim is a takeover and counts as one more attempt.
local attempts = 1
local last = redis.call('XREVRANGE', KEYS[3], '+', '-', 'COUNT', 1)
if last[1] then
  local f = last[1][2]
  local fields = {}
  for i = 1, #f, 2 do fields[f[i]] = f[i + 1] end
  if fields['t'] == 'claimed' then
    attempts = (tonumber(fields['a']) or 1) + 1
  end
end
local now = redis.call('TIME')
local started = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
redis.call('HSET', KEYS[2], 'status', 'RUNNING', 'ownerToken', ARGV[1], 'ownerNode', ARGV[2],
  'leaseMs', ARGV[3], 'timeoutMs', ARGV[4], 'startedAt', started, 'attempts', attempts,
  'key', ARGV[6])
redis.call('PEXPIRE', KEYS[2], ARGV[3])
redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[7], '*',
  't', 'claimed', 'tok', ARGV[1], 'n', ARGV[2], 'a', attempts)
redis.call('PEXPIRE', KEYS[3], ARGV[5])
redis.call('LREM', KEYS[4], 0, ARGV[2])
return {0, attempts}
