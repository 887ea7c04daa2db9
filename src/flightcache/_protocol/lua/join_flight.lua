-- join_flight: one round trip that says what a caller of a flight should do, and claims the
-- flight for the caller when it is vacant (pending confirm_claim with a fencing token).
-- KEYS[1] result   KEYS[2] meta   KEYS[3] waiters   KEYS[4] stream
-- ARGV[1] node id of the caller   ARGV[2] waiters TTL ms
-- ARGV[3] claim mode: 'always' claim a vacant flight; 'first' only if the caller is first in
--         the waiters queue (after an owner's death, so the first-joined goes first)
-- ARGV[4] claim id (random, one per call)   ARGV[5] lease ms   ARGV[6] loader timeout ms
-- ARGV[7] key description (for inspect)   ARGV[8] stream TTL ms
-- ARGV[9] '1' to refresh: a stored result does not count (follow a running flight or claim
--         one that will overwrite it), '0' otherwise
-- ARGV[10] a follower's stream position ('' for none): if the flight it followed ended
--         after it (an error or done whose result is not stored), say so instead of claiming
-- ARGV[11] with refresh, a refresh-ahead: ignore the stored result only while it has at
--         most this many ms left ('0': always); one with more was refreshed already
-- Returns {1, value}                        hit: the stored value (or error record)
--         {2, token, lease_left_ms, rank, from_id}
--                                           follow: a flight is live; token is '0' while its
--                                           owner has not confirmed yet; the caller is now in
--                                           waiters at 0-based position `rank`; `from_id` is
--                                           this flight's `claimed` event: every chunk and
--                                           the end of the flight come after it
--         {3, attempts, entry}              claimed: meta is CLAIMING under the claim id, and
--                                           a `claimed` event is on the stream, the first
--                                           entry left on it (earlier flights are trimmed),
--                                           whose id is `entry`
--         {0, rank}                         vacant and not claimed: not first in the queue
--         {4, type, v, n}                   ended: the newest event after ARGV[10] is a
--                                           `done` or `error` (v, n: its fields, or '')
if ARGV[9] ~= '1' or (tonumber(ARGV[11]) or 0) > 0 then
  local value = redis.call('GET', KEYS[1])
  if value and (ARGV[9] ~= '1' or redis.call('PTTL', KEYS[1]) > tonumber(ARGV[11])) then
    return {1, value}
  end
end
local rank = redis.call('LPOS', KEYS[3], ARGV[1])
if redis.call('EXISTS', KEYS[2]) == 1 then
  local token = redis.call('HGET', KEYS[2], 'ownerToken') or '0'
  if token == '0' and redis.call('HGET', KEYS[2], 'claimId') == ARGV[4] then
    -- this very call, sent again after a lost reply (a driver retry): it is the claimer
    local claim = redis.call('HMGET', KEYS[2], 'attempts', 'claimEntry')
    return {3, tonumber(claim[1]), claim[2]}
  end
  if not rank then
    rank = redis.call('RPUSH', KEYS[3], ARGV[1]) - 1
  end
  redis.call('PEXPIRE', KEYS[3], ARGV[2])
  local from = redis.call('HGET', KEYS[2], 'claimEntry') or '0-0'
  return {2, token, redis.call('PTTL', KEYS[2]), rank, from}
end
if ARGV[10] ~= '' then
  local tail = redis.call('XREVRANGE', KEYS[4], '+', '(' .. ARGV[10], 'COUNT', 1)
  if tail[1] then
    local f = tail[1][2]
    local fields = {}
    for i = 1, #f, 2 do fields[f[i]] = f[i + 1] end
    if fields['t'] == 'done' or fields['t'] == 'error' then
      return {4, fields['t'], fields['v'] or '', fields['n'] or ''}
    end
  end
end
if ARGV[3] == 'first' and rank ~= 0 then
  return {0, rank or -1}
end
-- Vacant: claim it. Claims trim the stream, so its first entry is the previous flight's
-- claim; if the newest entry does not end that flight, its owner died mid-flight: this
-- claim is a takeover and counts as one more attempt.
local attempts = 1
local first = redis.call('XRANGE', KEYS[4], '-', '+', 'COUNT', 1)
local newest = redis.call('XREVRANGE', KEYS[4], '+', '-', 'COUNT', 1)
if first[1] and newest[1] then
  local function fields_of(entry)
    local f, out = entry[2], {}
    for i = 1, #f, 2 do out[f[i]] = f[i + 1] end
    return out
  end
  local opened, last = fields_of(first[1]), fields_of(newest[1])
  if opened['t'] == 'claimed' and last['t'] ~= 'done' and last['t'] ~= 'error' then
    attempts = (tonumber(opened['a']) or 1) + 1
  end
end
local now = redis.call('TIME')
local started = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
redis.call('HSET', KEYS[2], 'status', 'CLAIMING', 'claimId', ARGV[4], 'ownerNode', ARGV[1],
  'leaseMs', ARGV[5], 'timeoutMs', ARGV[6], 'startedAt', started, 'attempts', attempts,
  'key', ARGV[7])
local entry = redis.call('XADD', KEYS[4], '*',
  't', 'claimed', 'n', ARGV[1], 'a', attempts, 'c', ARGV[4])
redis.call('XTRIM', KEYS[4], 'MINID', entry)
redis.call('PEXPIRE', KEYS[4], ARGV[8])
redis.call('HSET', KEYS[2], 'claimEntry', entry)
redis.call('PEXPIRE', KEYS[2], ARGV[5])
redis.call('LREM', KEYS[3], 0, ARGV[1])
return {3, attempts, entry}
