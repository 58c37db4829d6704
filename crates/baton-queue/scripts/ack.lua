-- Ack: acknowledge and delete the entries this consumer still owns, atomically.
-- KEYS[1] queue stream
-- ARGV[1] group, ARGV[2] consumer, ARGV[3..] entry ids
-- Returns one integer per id: 1 acked and deleted, 0 refused (not pending for this consumer).
local stream, group, me = KEYS[1], ARGV[1], ARGV[2]
local out, mine = {}, {}
for i = 3, #ARGV do
  local id = ARGV[i]
  local p = redis.call('XPENDING', stream, group, id, id, 1)
  if p[1] and p[1][2] == me then
    mine[#mine + 1] = id
    out[#out + 1] = 1
  else
    out[#out + 1] = 0
  end
end
-- XACK/XDEL take many ids; chunk to stay below Lua's unpack limit.
for i = 1, #mine, 1000 do
  local chunk = {}
  for j = i, math.min(i + 999, #mine) do chunk[#chunk + 1] = mine[j] end
  redis.call('XACK', stream, group, unpack(chunk))
  redis.call('XDEL', stream, unpack(chunk))
end
return out
