-- complete_flight: the owner's fenced write of the result.
-- KEYS[1] result   KEYS[2] meta   KEYS[3] stream   KEYS[4] waiters   KEYS[5] cost
-- A flight that an invalidation marked (meta field `invalidated`) delivers its result but
-- does not store it: it was computed from what the invalidation replaced.
-- ARGV[1] token   ARGV[2] encoded value   ARGV[3] result TTL ms (jitter applied; 0: do not
--         store it, only deliver it to the flight's callers)
-- ARGV[4] '1' to carry the value inside the done event, '0' not to (unless not stored)
-- ARGV[5] how long the stream lingers after the flight, ms
-- ARGV[6] chunk count of a stream flight ('' for a value), carried in the done event so a
--         follower knows it saw every chunk
-- ARGV[7] how long the loader ran, ms (kept beside a value's result, KEYS[5], for
--         refresh-ahead; not beside a stream's, which refresh-ahead never reads)
-- ARGV[8] wake channel prefix   ARGV[9] digest   ARGV[10] wake message limit (bytes)
-- ARGV[11] claim id ('' where the join took the token itself)
-- ARGV[12] sequence number of the first trailing chunk   ARGV[13...] encoded chunks: a
--          stream's last chunks, appended as append_chunks would before the done event
--          (absent: none), but for those the stream's newest chunk of this token shows
--          appended already
-- The done event carries `x` (the result's TTL ms) and `c` (ARGV[7]), or `nc` = 1 when
-- the result was not stored.
-- Returns 1 written, 2 delivered but not stored (an invalidation marked it), 0 fenced:
-- the token is not the current owner's, nothing was written
-- include: _wake.lua
-- include: _chunks.lua
-- include: _live.lua
-- include: _fence.lua
if not owns(KEYS[2], ARGV[1], ARGV[11] or '') then
  return 0
end
local w = wake_start(KEYS[4], KEYS[3])
if #ARGV > 12 then
  -- The owner's last append may have run before this call or not yet (docs/protocol.md,
  -- "the owner"): the trailing chunks the stream holds already are not added again.
  local first = tonumber(ARGV[12])
  local skip = 0
  local newest
  if w then
    newest = w.newest  -- (read by wake_start already)
  else
    newest = redis.call('XREVRANGE', KEYS[3], '+', '-', 'COUNT', 1)[1]
  end
  if newest then
    local f = newest[2]
    if f[2] == 'chunk' and f[4] == ARGV[1] then
      skip = math.max(0, tonumber(f[6]) + 1 - first)
    end
  end
  add_chunks(w, KEYS[3], ARGV[1], first + skip, 13 + skip)
end
local stored = tonumber(ARGV[3]) > 0 and redis.call('HGET', KEYS[2], 'invalidated') ~= '1'
local event = {'t', 'done', 'tok', ARGV[1]}
if stored then
  redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
  if ARGV[6] == '' then  -- a stream's cost is nobody's: refresh-ahead is for values only
    redis.call('SET', KEYS[5], ARGV[7], 'PX', ARGV[3])
  end
  table.insert(event, 'x')
  table.insert(event, ARGV[3])
  table.insert(event, 'c')
  table.insert(event, ARGV[7])
else
  table.insert(event, 'nc')
  table.insert(event, '1')
end
if ARGV[4] == '1' or not stored then  -- an unstored value can only travel in the event
  table.insert(event, 'v')
  table.insert(event, ARGV[2])
end
if ARGV[6] ~= '' then
  table.insert(event, 'n')
  table.insert(event, ARGV[6])
end
wake_add(w, redis.call('XADD', KEYS[3], '*', unpack(event)), event)
redis.call('PEXPIRE', KEYS[3], ARGV[5])
wake_send(w, ARGV[8], ARGV[9], ARGV[10])
redis.call('DEL', KEYS[2], KEYS[4])
if stored then
  return 1
end
return 2
