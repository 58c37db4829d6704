-- Settle: acks and parks of one consumer's leases, atomically, in one call.
-- KEYS[1] queue stream, KEYS[2] fence hash (reclaim.lua), KEYS[3..8] as caps.lua (prepended):
-- acked entries free their concurrency slots
-- ARGV[1] group, ARGV[2] consumer, ARGV[3] the parked owner, then triples (op, id, fence):
--   fence '' settles whatever delivery of the entry this consumer owns, a number only that
--   delivery (another fence counts as another consumer's: -1);
--   'a' ack (XACK + XDEL) an entry this consumer owns; 'A' the same for a released lease, which
--   may also be owned by the parked owner (nobody took it since it was released);
--   'p' park: hand an entry this consumer owns to the parked owner with idle 0 (reclaimable by
--   any consumer after the claim timeout, counting as a delivery); 'P' park a released lease
--   (already parked: left as it is).
-- Acked entries' fences are removed.
-- Returns one integer per triple: 1 done, 0 not pending (acked or deleted), -1 another consumer
-- (or a later delivery) owns it.
local stream, group, me, parked = KEYS[1], ARGV[1], ARGV[2], ARGV[3]
local out, acks = {}, {}
for i = 4, #ARGV, 3 do
  local op, id, fence = ARGV[i], ARGV[i + 1], ARGV[i + 2]
  local p = redis.call('XPENDING', stream, group, id, id, 1)
  local owner = p[1] and p[1][2]
  local released = (op == 'A' or op == 'P')
  if not owner then
    out[#out + 1] = 0
  elseif fence ~= '' and (redis.call('HGET', KEYS[2], id) or '0') ~= fence then
    out[#out + 1] = -1
  elseif owner == me or (released and owner == parked) then
    if op == 'a' or op == 'A' then
      acks[#acks + 1] = id
    elseif owner == me then
      redis.call('XCLAIM', stream, group, parked, 0, id, 'JUSTID')
    end
    out[#out + 1] = 1
  else
    out[#out + 1] = -1
  end
end
-- XACK/XDEL take many ids; chunk to stay below Lua's unpack limit.
for i = 1, #acks, 1000 do
  local chunk = {}
  for j = i, math.min(i + 999, #acks) do chunk[#chunk + 1] = acks[j] end
  redis.call('XACK', stream, group, unpack(chunk))
  redis.call('XDEL', stream, unpack(chunk))
  redis.call('HDEL', KEYS[2], unpack(chunk))
end
if #acks > 0 then
  local C = caps_keys(3)
  if redis.call('EXISTS', C.ids) == 1 then
    for _, id in ipairs(acks) do caps_release(C, stream, id) end
  end
  caps_wake(C)
end
return out
