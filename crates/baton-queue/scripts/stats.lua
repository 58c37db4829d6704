-- Queue statistics in one round trip.
-- KEYS[1] queue stream, KEYS[2] dead-letter stream, KEYS[3] delayed zset; ARGV[1] group,
-- ARGV[2] the parked owner (not a consumer: not counted)
-- Returns {length, pending, consumers, lag, delayed, dead letters}.
local len, pending, consumers, lag = 0, 0, 0, 0
if redis.call('EXISTS', KEYS[1]) == 1 then
  len = redis.call('XLEN', KEYS[1])
  lag = len -- until the group exists, nothing has been delivered
  for _, g in ipairs(redis.call('XINFO', 'GROUPS', KEYS[1])) do
    local m = {}
    for i = 1, #g, 2 do m[g[i]] = g[i + 1] end
    if m['name'] == ARGV[1] then
      pending, consumers = m['pending'], m['consumers']
      if consumers > 0 then
        for _, c in ipairs(redis.call('XINFO', 'CONSUMERS', KEYS[1], ARGV[1])) do
          if c[2] == ARGV[2] then consumers = consumers - 1 end
        end
      end
      lag = m['lag']
      if not lag then
        -- Redis cannot tell the lag (deletions after the last delivered id): count them.
        lag = #redis.call('XRANGE', KEYS[1], '(' .. m['last-delivered-id'], '+')
      end
    end
  end
end
return {len, pending, consumers, lag, redis.call('ZCARD', KEYS[3]), redis.call('XLEN', KEYS[2])}
