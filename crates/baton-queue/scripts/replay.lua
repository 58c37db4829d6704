-- Replay dead letters: move them back to the queue's tail with a fresh delivery count.
-- KEYS[1] queue stream, KEYS[2] dead-letter stream
-- ARGV[1] 'one' with ARGV[2] = dead-letter id: returns the new id, or false if not found.
-- ARGV[1] 'all' with ARGV[2] = limit: returns how many were replayed.
local function payload_of(fields)
  for i = 1, #fields, 2 do
    if fields[i] == 'p' then return fields[i + 1] end
  end
  return ''
end
if ARGV[1] == 'one' then
  local e = redis.call('XRANGE', KEYS[2], ARGV[2], ARGV[2])
  if not e[1] then return false end
  local nid = redis.call('XADD', KEYS[1], '*', 'p', payload_of(e[1][2]))
  redis.call('XDEL', KEYS[2], ARGV[2])
  return nid
end
local es = redis.call('XRANGE', KEYS[2], '-', '+', 'COUNT', tonumber(ARGV[2]))
for _, e in ipairs(es) do
  redis.call('XADD', KEYS[1], '*', 'p', payload_of(e[2]))
  redis.call('XDEL', KEYS[2], e[1])
end
return #es
