-- bloom_check: whether each of several keys may be in a Bloom filter (all its k bits set).
-- KEYS[1] bitmap   KEYS[2] parameters (a string, "<scheme>:<m bits>:<k hashes>")
-- ARGV[1] the caller's parameters   ARGV[2] k   ARGV[3..] bit offsets, k per key, in order
-- Returns {1, maybe_1, maybe_2, ...}: maybe_i is 1 if every bit of key i is set, else 0
--         (a missing bitmap reads as all zeros); {0, stored parameters} if the filter was
--         made with other parameters
local stored = redis.call('GET', KEYS[2])
if stored and stored ~= ARGV[1] then
  return {0, stored}
end
local k = tonumber(ARGV[2])
local out = {1}
for first = 3, #ARGV, k do
  local maybe = 1
  for i = first, first + k - 1 do
    if redis.call('GETBIT', KEYS[1], ARGV[i]) == 0 then
      maybe = 0
      break
    end
  end
  out[#out + 1] = maybe
end
return out
