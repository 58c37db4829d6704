-- Scheduled entries: named members of the delayed set (see reclaim.lua, which promotes them at
-- their due time exactly as it promotes a long RetryAfter's entries). A name never parses as a
-- stream entry id (it holds a ':'), so it cannot collide with a RetryAfter member; the payload
-- hash counts the named members in its field `~scheduled` (reclaim.lua lowers it as it promotes).
-- KEYS[1] delayed zset, KEYS[2] delayed payload hash
-- A scheduled entry's concurrency key and priority, if any, wait beside its payload as `<name>:k`
-- and `<name>:pr`.
-- ARGV[1] op: 'add' (ARGV[2] name, ARGV[3] due ms, server time; ARGV[4] payload; ARGV[5] the
-- concurrency key or '' none, ARGV[6] the priority, '' or 0 for none), 'move' (ARGV[2]
-- name, ARGV[3] due ms), 'remove' (ARGV[2] name) or 'count' (ARGV[2] most members to look at
-- for the earliest scheduled one).
-- Returns: add: 1 added, 0 replaced; move / remove: 1 done, 0 not waiting (promoted already, or
-- never scheduled); count: {scheduled, due ms of the earliest one or -1}.
local z, h, op = KEYS[1], KEYS[2], ARGV[1]
if op == 'add' then
  local added = redis.call('ZADD', z, ARGV[3], ARGV[2])
  redis.call('HSET', h, ARGV[2], ARGV[4])
  if (ARGV[5] or '') ~= '' then redis.call('HSET', h, ARGV[2] .. ':k', ARGV[5]) else redis.call('HDEL', h, ARGV[2] .. ':k') end
  if (tonumber(ARGV[6]) or 0) ~= 0 then redis.call('HSET', h, ARGV[2] .. ':pr', ARGV[6]) else redis.call('HDEL', h, ARGV[2] .. ':pr') end
  if added == 1 then redis.call('HINCRBY', h, '~scheduled', 1) end
  return added
elseif op == 'move' then
  if not redis.call('ZSCORE', z, ARGV[2]) then return 0 end
  redis.call('ZADD', z, 'XX', ARGV[3], ARGV[2])
  return 1
elseif op == 'remove' then
  local n = redis.call('ZREM', z, ARGV[2])
  if n == 1 then
    redis.call('HDEL', h, ARGV[2], ARGV[2] .. ':k', ARGV[2] .. ':pr')
    redis.call('HINCRBY', h, '~scheduled', -1)
  end
  return n
else
  local count = tonumber(redis.call('HGET', h, '~scheduled') or '0')
  local first = -1
  if count > 0 then
    local seen, step, max = 0, 100, tonumber(ARGV[2])
    while first < 0 and seen < max do
      local page = redis.call('ZRANGE', z, seen, seen + step - 1, 'WITHSCORES')
      if #page == 0 then break end
      for i = 1, #page, 2 do
        if string.find(page[i], ':', 1, true) then first = tonumber(page[i + 1]); break end
      end
      seen = seen + step
    end
  end
  return {count, first}
end
