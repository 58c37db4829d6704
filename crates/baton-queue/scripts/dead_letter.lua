-- Move an entry this consumer owns to the dead-letter stream, atomically with its removal.
-- KEYS[1] queue stream, KEYS[2] dead-letter stream
-- ARGV[1] group, ARGV[2] consumer, ARGV[3] id, ARGV[4] deliveries, ARGV[5] reason, ARGV[6] now (ms)
-- Returns 1, or 0 when not owned.
local stream, group, me, id = KEYS[1], ARGV[1], ARGV[2], ARGV[3]
local p = redis.call('XPENDING', stream, group, id, id, 1)
if not (p[1] and p[1][2] == me) then return 0 end
local payload = ''
local e = redis.call('XRANGE', stream, id, id)
if e[1] then
  local fields = e[1][2]
  for i = 1, #fields, 2 do
    if fields[i] == 'p' then payload = fields[i + 1] end
  end
end
redis.call('XADD', KEYS[2], '*', 'id', id, 'p', payload, 'dc', ARGV[4], 'reason', ARGV[5], 'at', ARGV[6])
redis.call('XACK', stream, group, id)
redis.call('XDEL', stream, id)
return 1
