-- Tombstone of the re-send guard (write_guard.lua), joined after common.lua by the scripts that
-- delete a stream's hash: delete.lua, and refs.lua when it collects a soft-deleted stream.
-- KEYS[3] = the stream's tombstone, baton:s:{path}:gone (the stream's hash tag, so its slot).
-- The guard's fields die with the hash, so a copy of a call to the deleted stream, re-sent after
-- a stream was created again at the path, would find no field and be written to the new stream.
-- bury() keeps the 'r:<writer>' fields of calls made within twice the re-send window (the age
-- write.lua's clean-up drops, by the token's time) in the tombstone for RW ms, the longest a copy
-- can arrive after its call ran (CLUSTER_RESEND_WINDOW, checked by a test), and create.lua
-- carries them into the new hash. Each is kept with its kind upper-cased ('F', 'M', 'K': carried),
-- and one field 'r~' holds the incarnation of the deleted stream, the one all of them ran on:
-- write.lua answers a carried field's copy with it (the first copy's reply). One field for all
-- (not one per writer) keeps the hash as small as before the delete (a listpack, write_guard.lua).
-- A field carried already (upper-case: a call on an even older stream, carried by an earlier
-- delete) is dropped, as its incarnation is not the deleted stream's. Limit: a copy re-sent
-- across two deletes and creates within its re-send window finds no field and is written to the
-- newest stream. Nothing is kept when no lower-case field is recent (standalone and Sentinel
-- write no guard). The write scripts never read the tombstone.
local RW = 300000
local function bury(inc)
  local all = redis.call('HGETALL', KM)
  local t = redis.call('TIME')
  local cutoff = tonumber(t[1]) - 2 * RW / 1000
  local keep = {}
  for i = 1, #all, 2 do
    local f, val = all[i], all[i + 1]
    if string.sub(f, 1, 2) == 'r:' then
      local nl = string.find(val, '\n', 1, true)
      local tok = nl and tonumber(string.sub(val, 1, nl - 1))
      local kind = nl and string.sub(val, nl + 1, nl + 1)
      if tok and math.floor(tok / 1048576) >= cutoff and kind == string.lower(kind) then
        keep[#keep + 1] = f
        keep[#keep + 1] = string.sub(val, 1, nl) .. string.upper(kind) .. string.sub(val, nl + 2)
      end
    end
  end
  if #keep == 0 then return end
  keep[#keep + 1] = 'r~'
  keep[#keep + 1] = inc
  for i = 1, #keep, 1000 do redis.call('HSET', KEYS[3], unpack(keep, i, math.min(i + 999, #keep))) end
  redis.call('PEXPIRE', KEYS[3], RW)
end
