-- _wake.lua: not a script of its own; included by the scripts that append to a flight's
-- stream, so each tells the nodes queued in the flight's waiters list what it appended, in
-- the same atomic call (docs/protocol.md, "The wake channel").
-- wake_start(waiters, stream) before the first XADD: the queued nodes and the stream's newest
-- entry, whose id is the message's `prev` (nil when nobody waits: nothing to tell).
-- wake_add(w, id, fields) for each entry appended. wake_send(w, prefix, digest, limit)
-- publishes one message on <prefix><node> to each node: netstrings of digest, prev, then per
-- entry its id, field count and fields; the entries are left out (a bare hint) when they
-- would exceed `limit` bytes.
local function wake_ns(s)
  s = tostring(s)
  return #s .. ':' .. s
end
local function wake_start(waiters, stream)
  local nodes = redis.call('LRANGE', waiters, 0, -1)
  if #nodes == 0 then
    return nil
  end
  local newest = redis.call('XREVRANGE', stream, '+', '-', 'COUNT', 1)[1]
  return {nodes = nodes, newest = newest, parts = {}}
end
local function wake_add(w, id, fields)
  if w then
    local parts = w.parts
    parts[#parts + 1] = wake_ns(id)
    parts[#parts + 1] = wake_ns(#fields)
    for i = 1, #fields do
      parts[#parts + 1] = wake_ns(fields[i])
    end
  end
end
local function wake_send(w, prefix, digest, limit)
  if not w then
    return
  end
  local body = table.concat(w.parts)
  if #body > tonumber(limit) then
    body = ''
  end
  local prev = w.newest and w.newest[1] or '0-0'
  local message = wake_ns(digest) .. wake_ns(prev) .. body
  local seen = {}
  for _, node in ipairs(w.nodes) do
    if not seen[node] then
      seen[node] = true
      redis.call('PUBLISH', prefix .. node, message)
    end
  end
end
