-- Replay dead letters: move them back to the queue's tail with a fresh delivery count, with the
-- concurrency key and priority they had (fields `k`, `pr` of the dead letter; caps.lua's
-- caps_add, prepended, marks the queue for the priorities).
-- KEYS[1] queue stream, KEYS[2] dead-letter stream, KEYS[3..10] as caps.lua
-- ARGV[1] 'one' with ARGV[2] = dead-letter id: returns the new id, or false if not found.
-- ARGV[1] 'all' with ARGV[2] = limit: returns how many were replayed.
local C = caps_keys(3)
local function offer(fields)
  local payload, key, pr = '', nil, nil
  for i = 1, #fields, 2 do
    if fields[i] == 'p' then payload = fields[i + 1]
    elseif fields[i] == 'k' then key = fields[i + 1]
    elseif fields[i] == 'pr' then pr = fields[i + 1] end
  end
  local f = {'p', payload}
  if key then
    f[3] = 'k'
    f[4] = key
  end
  return caps_add(C, KEYS[1], f, pr)
end
if ARGV[1] == 'one' then
  local e = redis.call('XRANGE', KEYS[2], ARGV[2], ARGV[2])
  if not e[1] then return false end
  local nid = offer(e[1][2])
  redis.call('XDEL', KEYS[2], ARGV[2])
  return nid
end
local es = redis.call('XRANGE', KEYS[2], '-', '+', 'COUNT', tonumber(ARGV[2]))
for _, e in ipairs(es) do
  offer(e[2])
  redis.call('XDEL', KEYS[2], e[1])
end
return #es
