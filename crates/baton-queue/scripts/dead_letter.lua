-- Move an entry this consumer owns (or, for a released lease, the parked owner does) to the
-- dead-letter stream, atomically with its removal, with its concurrency key and priority (`k`,
-- `pr`) if it has them, for a replay.
-- KEYS[1] queue stream, KEYS[2] dead-letter stream, KEYS[3] fence hash (reclaim.lua), KEYS[4..11]
-- as caps.lua (prepended): the entry frees its concurrency slots
-- ARGV[1] group, ARGV[2] consumer, ARGV[3] the parked owner, ARGV[4] id, ARGV[5] deliveries,
-- ARGV[6] reason, ARGV[7] '1' for a released lease, ARGV[8] the delivery's fence or '' (as in
-- retry_after.lua)
-- Returns 1 done, 0 not pending, -1 another consumer owns it.
local stream, group, me, parked, id = KEYS[1], ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local p = redis.call('XPENDING', stream, group, id, id, 1)
if not p[1] then return 0 end
if not (p[1][2] == me or (ARGV[7] == '1' and p[1][2] == parked)) then return -1 end
if ARGV[8] ~= '' and (redis.call('HGET', KEYS[3], id) or '0') ~= ARGV[8] then return -1 end
local payload, extra = '', {}
local e = redis.call('XRANGE', stream, id, id)
if e[1] then
  local fields = e[1][2]
  for i = 1, #fields, 2 do
    if fields[i] == 'p' then payload = fields[i + 1]
    elseif fields[i] == 'k' or fields[i] == 'pr' then
      extra[#extra + 1] = fields[i]
      extra[#extra + 1] = fields[i + 1]
    end
  end
end
local t = redis.call('TIME')
redis.call('XADD', KEYS[2], '*', 'id', id, 'p', payload, 'dc', ARGV[5], 'reason', ARGV[6], 'at', t[1] * 1000 + math.floor(t[2] / 1000), unpack(extra))
redis.call('XACK', stream, group, id)
redis.call('XDEL', stream, id)
redis.call('HDEL', KEYS[3], id)
local C = caps_keys(4)
caps_release(C, stream, id)
caps_wake(C)
return 1
