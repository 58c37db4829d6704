-- Queue statistics in one round trip.
-- KEYS[1] queue stream, KEYS[2] dead-letter stream, KEYS[3] delayed zset, KEYS[4] liveness hash
-- (consumers.lua), KEYS[5] pause flag (pause.lua), KEYS[6] back-off (backoff.lua), KEYS[7] the
-- priorities' ready set (caps.lua; its entries are new entries of the queue, out of the stream),
-- KEYS[8] the key waiting line (caps.lua); ARGV[1] group, ARGV[2] the parked owner (not a
-- consumer: not counted)
-- Returns {length, pending, live consumers, lag, delayed, dead letters, dead consumers, paused
-- since (ms, 0: not paused), back-off left (ms, 0: none), entries waiting for a key slot}: a
-- consumer is live while its last heartbeat is younger than its claim timeout (its record
-- `<ms>:<claim ms>`); a group member with an older record or none is dead (not reaped yet, or
-- still owning entries after it stopped).
local len, pending, consumers, lag, dead = 0, 0, 0, 0, 0
if redis.call('EXISTS', KEYS[1]) == 1 then
  len = redis.call('XLEN', KEYS[1])
  lag = len -- until the group exists, nothing has been delivered
  for _, g in ipairs(redis.call('XINFO', 'GROUPS', KEYS[1])) do
    local m = {}
    for i = 1, #g, 2 do m[g[i]] = g[i + 1] end
    if m['name'] == ARGV[1] then
      pending = m['pending']
      if m['consumers'] > 0 then
        local t = redis.call('TIME')
        local now = t[1] * 1000 + math.floor(t[2] / 1000)
        for _, c in ipairs(redis.call('XINFO', 'CONSUMERS', KEYS[1], ARGV[1])) do
          if c[2] ~= ARGV[2] then
            local rec = redis.call('HGET', KEYS[4], c[2])
            local seen, claim = nil, nil
            if rec then seen, claim = string.match(rec, '^(%d+):(%d+)') end
            if seen and now - tonumber(seen) < tonumber(claim) then
              consumers = consumers + 1
            else
              dead = dead + 1
            end
          end
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
-- New entries waiting in the priorities' ready set count as the queue's and as never delivered.
local ready = redis.call('ZCARD', KEYS[7])
len = len + ready
lag = lag + ready
local paused = tonumber(redis.call('GET', KEYS[5]) or '0') or 0
local backoff = math.max(redis.call('PTTL', KEYS[6]), 0)
return {len, pending, consumers, lag, redis.call('ZCARD', KEYS[3]), redis.call('XLEN', KEYS[2]), dead, paused, backoff,
  redis.call('ZCARD', KEYS[8])}
