-- _chunks.lua: not a script of its own; included (after _wake.lua) by the scripts that
-- append a stream's chunks: append_chunks, and complete_flight for a stream's last ones.
-- add_chunks(w, stream, token, seq, first): one event {t=chunk, tok, s, v} per ARGV[first...],
-- in order, numbered from `seq`, each added to the wake message `w`.
local function add_chunks(w, stream, token, seq, first)
  for i = first, #ARGV do
    local event = {'t', 'chunk', 'tok', token, 's', seq, 'v', ARGV[i]}
    wake_add(w, redis.call('XADD', stream, '*', unpack(event)), event)
    seq = seq + 1
  end
end
