-- bloom_add: set the k bits of each of several keys in a Bloom filter's bitmap.
-- KEYS[1] bitmap   KEYS[2] parameters (a string, "<scheme>:<m bits>:<k hashes>")
-- ARGV[1] the caller's parameters   ARGV[2] k   ARGV[3..] bit offsets, k per key, in order
-- Returns {1, new_1, new_2, ...}: new_i is 1 if some bit of key i was still 0 (it was not
--         in the filter before), else 0; {0, stored parameters} if the filter was made with
--         other parameters (nothing is set)
local stored = redis.call('GET', KEYS[2])
if stored and stored ~= ARGV[1] then
  return {0, stored}
end
if not stored then
  redis.call('SET', KEYS[2], ARGV[1])
end
local k = tonumber(ARGV[2])
local out = {1}
for first = 3, #ARGV, k do
  local new = 0
  for i = first, first + k - 1 do
    if redis.call('SETBIT', KEYS[1], ARGV[i], 1) == 0 then
      new = 1
    end
  end
  out[#out + 1] = new
end
return out
