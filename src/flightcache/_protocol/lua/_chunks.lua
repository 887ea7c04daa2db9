-- _chunks.lua: not a script of its own; included (after _wake.lua) by the scripts that
-- append a stream's chunks: append_chunks, and complete_flight for a stream's last ones.
-- add_chunks(w, stream, token, seq, first): one event {t=chunk, tok, s, v} per ARGV[first...],
-- in order, numbered from `seq`, each added to the wake message `w` as wake_add would add
-- it. Written out here, not through wake_add: the netstrings every chunk event shares (its
-- field count, its names, the token) are made once a call, and a chunk costs one string of
-- its own instead of a table and ten small strings (a call of 5 chunks to a node that waits
-- took 64 us of the server's time, 39 us so; of 20, 212 us and 113 us).
local function add_chunks(w, stream, token, seq, first)
  local parts = w and w.parts
  local shared = parts and wake_ns(8) .. wake_ns('t') .. wake_ns('chunk') .. wake_ns('tok')
    .. wake_ns(token) .. wake_ns('s')
  local v = parts and wake_ns('v')
  for i = first, #ARGV do
    local value = ARGV[i]
    local id = redis.call('XADD', stream, '*', 't', 'chunk', 'tok', token, 's', seq, 'v', value)
    if parts then  -- (the value's netstring made in place: wake_ns would copy it once more)
      parts[#parts + 1] = wake_ns(id) .. shared .. wake_ns(seq) .. v .. #value .. ':' .. value
    end
    seq = seq + 1
  end
end
