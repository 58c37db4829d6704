-- Retry after a delay, if this consumer still owns the entry (or, for a released lease, the
-- parked owner does).
-- KEYS[1] queue stream, KEYS[2] delayed zset, KEYS[3] delayed payload hash, KEYS[4] fence hash
-- (reclaim.lua), KEYS[5..12] as caps.lua (prepended): the delayed set's path takes the entry out of
-- the pending list, so it frees its concurrency slots; its key and priority go with it (`<id>:k`, `<id>:pr`) and it
-- passes the gate again when due
-- ARGV[1] group, ARGV[2] consumer, ARGV[3] the parked owner, ARGV[4] id, ARGV[5] claim timeout
-- (ms), ARGV[6] delay (ms), ARGV[7] '1' for a released lease, ARGV[8] the delivery's fence or ''
-- (any delivery this consumer owns; a fence that is not the entry's counts as another owner)
-- delay < claim timeout: hand the entry to the parked owner with idle (claim timeout - delay), so
-- that a reclaim tick takes it once the delay has passed. Otherwise (XCLAIM clamps idle times to
-- the past, so a later time cannot be set): move it to the delayed set (due time in server time),
-- carrying its delivery count; a reclaim tick re-offers it when due. A redelivery asked for this
-- way is a scheduled re-poll, not a failure: the delivery count is set back by one (XCLAIM
-- RETRYCOUNT), so it never counts toward max deliveries.
-- Returns 1 done, 0 not pending, -1 another consumer owns it.
local stream, group, me, parked, id = KEYS[1], ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local claim_ms, delay = tonumber(ARGV[5]), tonumber(ARGV[6])
local p = redis.call('XPENDING', stream, group, id, id, 1)
if not p[1] then return 0 end
if not (p[1][2] == me or (ARGV[7] == '1' and p[1][2] == parked)) then return -1 end
if ARGV[8] ~= '' and (redis.call('HGET', KEYS[4], id) or '0') ~= ARGV[8] then return -1 end
if delay < claim_ms then
  redis.call('XCLAIM', stream, group, parked, 0, id, 'IDLE', claim_ms - delay, 'RETRYCOUNT', p[1][4] - 1, 'JUSTID')
  return 1
end
local e = redis.call('XRANGE', stream, id, id)
if e[1] then
  local fields, payload, prior, key, pr = e[1][2], nil, 0, nil, nil
  for i = 1, #fields, 2 do
    if fields[i] == 'p' then payload = fields[i + 1]
    elseif fields[i] == 'dc' then prior = tonumber(fields[i + 1]) or 0
    elseif fields[i] == 'k' then key = fields[i + 1]
    elseif fields[i] == 'pr' then pr = fields[i + 1] end
  end
  if payload then
    local t = redis.call('TIME')
    redis.call('ZADD', KEYS[2], t[1] * 1000 + math.floor(t[2] / 1000) + delay, id)
    redis.call('HSET', KEYS[3], id, payload, id .. ':dc', prior + p[1][4] - 1)
    if key then redis.call('HSET', KEYS[3], id .. ':k', key) end
    if pr then redis.call('HSET', KEYS[3], id .. ':pr', pr) end
  end
end
redis.call('XACK', stream, group, id)
redis.call('XDEL', stream, id)
redis.call('HDEL', KEYS[4], id)
local C = caps_keys(5)
caps_release(C, stream, id)
caps_wake(C)
return 1
