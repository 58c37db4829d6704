-- fork reference count (PROTOCOL.md 4.2). ARGV: 1 '+' or '-'.
-- KEYS[3]: the tombstone (bury.lua, joined before): collecting a soft-deleted stream keeps its
-- re-send guard there, as delete.lua does.
local m = load_meta()
if not m then return {'none', ''} end
local refs = tonumber(m.refs or '0')
if ARGV[1] == '+' then
  if m.del then return {'none', ''} end
  redis.call('HSET', KM, 'refs', s(refs + 1))
  return {'kept', ''}
end
refs = math.max(0, refs - 1)
if refs == 0 and m.del then
  bury(m.inc)
  redis.call('DEL', KS, KM)
  return {'collected', m.fsrc or ''}
end
redis.call('HSET', KM, 'refs', s(refs))
return {'kept', ''}
