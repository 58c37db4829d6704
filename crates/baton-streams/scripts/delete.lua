-- delete (PROTOCOL.md 5.4): soft delete while forks reference the stream.
-- KEYS[3]: the tombstone (bury.lua, joined before): a hard delete keeps the re-send guard there.
local m = load_meta()
if not m then return {'nf'} end
if m.del then return {'gone'} end
if tonumber(m.refs or '0') > 0 then
  redis.call('HSET', KM, 'del', '1')
  redis.call('DEL', KS)
  return {'soft'}
end
bury(m.inc)
redis.call('DEL', KS, KM)
return {'deleted', m.fsrc or ''}
