-- append_chunks: the owner of a stream flight publishes chunks, fenced by its token.
-- KEYS[1] meta   KEYS[2] stream   KEYS[3] waiters
-- ARGV[1] token   ARGV[2] sequence number of the first chunk
-- ARGV[3] wake channel prefix   ARGV[4] digest   ARGV[5] wake message limit (bytes)
-- ARGV[6] claim id ('' where the join took the token itself)   ARGV[7...] encoded chunks
-- Each chunk becomes one event {t=chunk, tok, s, v}, in order.
-- Returns 1 appended, 0 fenced: the token is not the current owner's, nothing was written
-- include: _wake.lua
-- include: _chunks.lua
-- include: _live.lua
-- include: _fence.lua
if not owns(KEYS[1], ARGV[1], ARGV[6]) then
  return 0
end
local w = wake_start(KEYS[3], KEYS[2])
add_chunks(w, KEYS[2], ARGV[1], tonumber(ARGV[2]), 7)
wake_send(w, ARGV[3], ARGV[4], ARGV[5])
return 1
