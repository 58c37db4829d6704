-- Remove consumers of the group that are idle and own no pending entry (checked atomically, so
-- a consumer that just took an entry is never removed with it).
-- KEYS[1] queue stream; ARGV[1] group, ARGV[2] this consumer (never removed), ARGV[3] idle (ms)
-- Returns how many consumers were removed.
local n = 0
for _, c in ipairs(redis.call('XINFO', 'CONSUMERS', KEYS[1], ARGV[1])) do
  local m = {}
  for i = 1, #c, 2 do m[c[i]] = c[i + 1] end
  if m['name'] ~= ARGV[2] and tonumber(m['pending']) == 0 and tonumber(m['idle']) >= tonumber(ARGV[3]) then
    redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], m['name'])
    n = n + 1
  end
end
return n
