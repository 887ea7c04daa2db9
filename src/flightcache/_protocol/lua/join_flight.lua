-- join_flight: one round trip that says what a caller of a flight should do, and claims the
-- flight for the caller when it is vacant: with a fencing token at once when owner-seq is
-- on this server (KEYS[7] given), else pending confirm_claim.
-- KEYS[1] result   KEYS[2] meta   KEYS[3] waiters   KEYS[4] stream   KEYS[5] invalidation
-- marker   KEYS[6] cost   KEYS[7] owner-seq (only where it lives on this server)
-- KEYS[8] with KEYS[7], the caller's session key, when it has a session here
-- (docs/protocol.md, "Sessions"): a claim binds to it if it holds ARGV[16]
-- ARGV[1] node id of the caller   ARGV[2] waiters TTL ms
-- ARGV[3] claim mode: 'always' claim a vacant flight; 'first' only if the caller is first in
--         the waiters queue (after an owner's death, so the first-joined goes first);
--         'mine' never claim nor queue: only say whether this claim id holds the flight
-- ARGV[4] claim id (random, one per call)   ARGV[5] lease ms   ARGV[6] loader timeout ms
-- ARGV[7] key description (for inspect)   ARGV[8] stream TTL ms
-- ARGV[9] '1' to refresh: a stored result does not count (follow a running flight or claim
--         one that will overwrite it), '0' otherwise
-- ARGV[10] a follower's stream position ('' for none): if the flight it followed ended
--         after it (an error or done whose result is not stored), say so instead of claiming
-- ARGV[11] with refresh, a refresh-ahead: ignore the stored result only while it has at
--         most this many ms left ('0': always); one with more was refreshed already
-- ARGV[12] with KEYS[7]: 20 random bits, the token's low bits
-- ARGV[13] wake channel prefix   ARGV[14] digest   ARGV[15] wake message limit (bytes)
-- ARGV[16] with KEYS[8]: the session's epoch   ARGV[17] with KEYS[8]: the backstop ms, a
--         bound flight's own TTL (its meta, stream and waiters; its liveness is the session)
-- Returns {1, value, ttl_left_ms, marked, cost_ms}
--                                           hit: the stored value (or error record), its
--                                           PTTL, 1 while an invalidation marks it (serve,
--                                           do not lease), the loader's cost (0: unknown)
--         {2, token, lease_left_ms, rank, from_id, newest_id, epoch, node, own_left_ms}
--                                           follow: a flight is live (lease_left_ms: its
--                                           owner's session's, for a bound flight); token is '0' while its
--                                           owner has not confirmed yet; the caller is now in
--                                           waiters at 0-based position `rank`; `from_id` is
--                                           this flight's `claimed` event: every chunk and
--                                           the end of the flight come after it; `newest_id`
--                                           the stream's newest entry (`from_id` itself when
--                                           nothing came after it: no chunk to read back);
--                                           for a bound flight, the epoch and owner node of
--                                           the session it is bound to and meta's own TTL
--                                           (else '', '' and lease_left_ms again)
--         {3, attempts, entry, token, lease_left_ms, epoch}
--                                           claimed: (lease_left_ms: meta's own TTL; epoch:
--                                           the caller's session's, when meta is bound to
--                                           it, its TTL then the backstop; else '') with KEYS[7], meta is RUNNING under the
--                                           new token; without, token is '' and meta is
--                                           CLAIMING under the claim id. A `claimed` event is
--                                           on the stream (entries older than the linger are
--                                           trimmed), whose id is `entry`.
--                                           Also the answer to the same claim id sent again
--                                           (a retry), with the lease it has left
--         {0, rank}                         vacant and not claimed: not first in the queue
--         {4, type, v, n, claim}            ended: the first `done` or `error` after ARGV[10]
--                                           (v, n: its fields, or ''; claim: the last
--                                           `claimed` entry before it, '' if none)
-- include: _wake.lua
-- include: _live.lua
if ARGV[9] ~= '1' or (tonumber(ARGV[11]) or 0) > 0 then
  local value = redis.call('GET', KEYS[1])
  if value then
    local ttl = redis.call('PTTL', KEYS[1])
    if ARGV[9] ~= '1' or ttl > tonumber(ARGV[11]) then
      local cost = tonumber(redis.call('GET', KEYS[6]) or '0') or 0
      return {1, value, ttl, redis.call('EXISTS', KEYS[5]), cost}
    end
  end
end
local function fields_of(entry)
  local f, out = entry[2], {}
  for i = 1, #f, 2 do out[f[i]] = f[i + 1] end
  return out
end
if ARGV[10] ~= '' then
  -- The first end of a flight after the caller's position, read in order: its own
  -- flight's, or a takeover's (a `claimed` crossed on the way: returned, so a stream
  -- follower knows the chunks started over). Checked before a running flight: a finished
  -- flight stays readable to its followers while its entries linger, whatever claims came
  -- after its end.
  local after = redis.call('XRANGE', KEYS[4], '(' .. ARGV[10], '+', 'COUNT', 1000)
  local crossed = ''
  for _, entry in ipairs(after) do
    local fields = fields_of(entry)
    if fields['t'] == 'claimed' then
      crossed = entry[1]
    elseif fields['t'] == 'done' or fields['t'] == 'error' then
      return {4, fields['t'], fields['v'] or '', fields['n'] or '', crossed}
    end
  end
end
local rank = redis.call('LPOS', KEYS[3], ARGV[1])
local alive, left, dead, epoch, node = live(KEYS[2])
if dead then
  -- Bound to a session that lapsed: the flight is vacant, as if meta had expired; none of
  -- its fields (its token, an invalidation's mark) may carry over to the next claim.
  redis.call('DEL', KEYS[2])
end
if alive then
  local token = redis.call('HGET', KEYS[2], 'ownerToken') or '0'
  if redis.call('HGET', KEYS[2], 'claimId') == ARGV[4] then
    -- this very call, sent again after a lost reply (a driver retry): it is the claimer
    local claim = redis.call('HMGET', KEYS[2], 'attempts', 'claimEntry', 'ownerToken', 'se')
    return {3, tonumber(claim[1]), claim[2], claim[3] or '', redis.call('PTTL', KEYS[2]),
      claim[4] or ''}
  end
  if ARGV[3] == 'mine' then
    return {0, -1}
  end
  if not rank then
    rank = redis.call('RPUSH', KEYS[3], ARGV[1]) - 1
  end
  -- The list lives at least as long as meta: a bound flight's own keys are renewed only
  -- every half of the backstop, and a list this join made (none waited before) must not
  -- lapse before that, taking the node out of the flight's wake-ups. Never shorter.
  local own = epoch and redis.call('PTTL', KEYS[2]) or left
  local ttl = math.max(tonumber(ARGV[2]), own)
  if redis.call('PTTL', KEYS[3]) < ttl then
    redis.call('PEXPIRE', KEYS[3], ttl)
  end
  local from = redis.call('HGET', KEYS[2], 'claimEntry') or '0-0'
  local newest = redis.call('XREVRANGE', KEYS[4], '+', '-', 'COUNT', 1)
  return {2, token, left, rank, from, newest[1] and newest[1][1] or from, epoch or '', node or '',
    own}
end
if ARGV[3] == 'mine' or (ARGV[3] == 'first' and rank ~= 0) then
  return {0, rank or -1}
end
-- Vacant: claim it. If the stream's newest entry does not end a flight, the last owner
-- died (or gave the flight back) mid-flight: this claim is a takeover, one more attempt than
-- that flight's claim, found by reading back from the newest entry.
local attempts = 1
local newest = redis.call('XREVRANGE', KEYS[4], '+', '-', 'COUNT', 1)
if newest[1] then
  local last = fields_of(newest[1])
  if last['t'] ~= 'done' and last['t'] ~= 'error' then
    local cursor = '+'
    local found = false
    repeat
      local batch = redis.call('XREVRANGE', KEYS[4], cursor, '-', 'COUNT', 100)
      for _, entry in ipairs(batch) do
        local fields = fields_of(entry)
        if fields['t'] == 'claimed' then
          attempts = (tonumber(fields['a']) or 1) + 1
          found = true
          break
        end
      end
      if #batch > 0 then
        cursor = '(' .. batch[#batch][1]
      end
    until found or #batch < 100
  end
end
local now = redis.call('TIME')
local started = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
local token = ''
local status = 'CLAIMING'
if KEYS[7] then
  -- counter * 2^20 + bits, in decimal, exact past 2^53 (Lua numbers are doubles): split the
  -- counter at 10^7 so every partial product stays exact.
  local counter = redis.call('INCR', KEYS[7])
  local high, low = math.floor(counter / 1e7), counter % 1e7
  local tail = low * 1048576 + tonumber(ARGV[12])
  local head = high * 1048576 + math.floor(tail / 1e7)
  tail = tail % 1e7
  token = head > 0 and string.format('%.0f%07d', head, tail) or string.format('%d', tail)
  status = 'RUNNING'
end
redis.call('LREM', KEYS[3], 0, ARGV[1])
local w = wake_start(KEYS[3], KEYS[4])
redis.call('HSET', KEYS[2], 'status', status, 'claimId', ARGV[4], 'ownerNode', ARGV[1],
  'leaseMs', ARGV[5], 'timeoutMs', ARGV[6], 'startedAt', started, 'attempts', attempts,
  'key', ARGV[7])
if token ~= '' then
  redis.call('HSET', KEYS[2], 'ownerToken', token)
end
local ttl = ARGV[5]
local bound = 0
if KEYS[8] and redis.call('GET', KEYS[8]) == ARGV[16] then
  -- Bound to the claimer's session: live while it holds this epoch; meta, the stream and
  -- waiters live for the backstop, renewed by the owner every half of it.
  redis.call('HSET', KEYS[2], 'se', ARGV[16])
  ttl, bound = ARGV[17], 1
end
local fields = {'t', 'claimed', 'n', ARGV[1], 'a', attempts, 'c', ARGV[4]}
local entry = redis.call('XADD', KEYS[4], '*', unpack(fields))
wake_add(w, entry, fields)
-- Only entries older than the linger go: an earlier flight's end stays readable to its
-- slow followers for the linger, as it would have without this claim.
local linger = tonumber(ARGV[8]) - tonumber(ARGV[5])
redis.call('XTRIM', KEYS[4], 'MINID', math.max(started - linger, 0))
redis.call('PEXPIRE', KEYS[4], bound == 1 and ARGV[17] or ARGV[8])
if bound == 1 and redis.call('EXISTS', KEYS[3]) == 1 then
  redis.call('PEXPIRE', KEYS[3], ARGV[17])  -- (nodes queued by joins before this claim)
end
redis.call('HSET', KEYS[2], 'claimEntry', entry)
redis.call('PEXPIRE', KEYS[2], ttl)
wake_send(w, ARGV[13], ARGV[14], ARGV[15])
return {3, attempts, entry, token, tonumber(ttl), bound == 1 and ARGV[16] or ''}
