-- append_chunks: the owner of a stream flight publishes chunks, fenced by its token.
-- KEYS[1] meta   KEYS[2] stream
-- ARGV[1] token   ARGV[2] sequence number of the first chunk   ARGV[3...] encoded chunks
-- Each chunk becomes one event {t=chunk, tok, s, v}, in order.
-- Returns 1 appended, 0 fenced: the token is not the current owner's, nothing was written
if redis.call('HGET', KEYS[1], 'ownerToken') ~= ARGV[1] then
  return 0
end
local seq = tonumber(ARGV[2])
for i = 3, #ARGV do
  redis.call('XADD', KEYS[2], '*', 't', 'chunk', 'tok', ARGV[1], 's', seq, 'v', ARGV[i])
  seq = seq + 1
end
return 1
