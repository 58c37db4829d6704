-- Leave: remove this consumer from the group and its liveness record, only if it owns no pending
-- entry (checked atomically: XGROUP DELCONSUMER would drop the pending entries it still owns).
-- When it still owns entries, its record becomes `0:<claim timeout ms>`: stopped, so that the
-- reclaim that takes its last entry removes it (reclaim.lua).
-- KEYS[1] queue stream, KEYS[2] liveness hash; ARGV[1] group, ARGV[2] consumer, ARGV[3] its claim
-- timeout (ms)
-- Returns 1 when it left, 0 when it still owns entries.
if redis.call('EXISTS', KEYS[1]) == 0 then
  redis.call('HDEL', KEYS[2], ARGV[2])
  return 1
end
if #redis.call('XPENDING', KEYS[1], ARGV[1], '-', '+', 1, ARGV[2]) > 0 then
  redis.call('HSET', KEYS[2], ARGV[2], '0:' .. ARGV[3])
  return 0
end
redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], ARGV[2])
redis.call('HDEL', KEYS[2], ARGV[2])
return 1
