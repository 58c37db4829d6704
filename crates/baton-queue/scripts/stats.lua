-- Queue statistics in one round trip.
-- KEYS[1] queue stream, KEYS[2] dead-letter stream, KEYS[3] delayed zset, KEYS[4] liveness hash
-- (consumers.lua), KEYS[5] pause flag (pause.lua), KEYS[6] back-off (backoff.lua), KEYS[7] the
-- priorities' ready set (caps.lua; its entries are new entries of the queue, out of the stream),
-- KEYS[8] key hold counts, KEYS[9] key waiting lines (caps.lua), KEYS[10] per-key rate state
-- (read.lua); ARGV[1] group, ARGV[2] the parked owner (not a consumer: not counted), ARGV[3] the
-- most keys to list, ARGV[4] the most fields of KEYS[8] and of KEYS[10] to look at
-- Returns {length, pending, live consumers, lag, delayed, dead letters, dead consumers, paused
-- since (ms, 0: not paused), back-off left (ms, 0: none), entries waiting in key waiting lines,
-- entries waiting in the delayed set for their key's rate, {key, active, waiting, rate delayed}
-- for up to ARGV[3] keys, most active + waiting + rate delayed first (then by key), among the
-- keys holding a slot and the keys with entries delayed for their rate (up to ARGV[4] of each
-- looked at: a key with waiters always holds a slot)}: a
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
-- Per key ---------------------------------------------------------------------------------------
local per, list = {}, {}
local function at(k)
  if not per[k] then
    per[k] = {k, 0, 0, 0}
    list[#list + 1] = per[k]
  end
  return per[k]
end
local bound = tonumber(ARGV[4])
local function scan(key, each)
  local cursor, seen = '0', 0
  repeat
    local r = redis.call('HSCAN', key, cursor, 'COUNT', 100)
    cursor = r[1]
    for i = 1, #r[2], 2 do
      if seen < bound then each(r[2][i], r[2][i + 1]) end
      seen = seen + 1
    end
  until cursor == '0' or seen >= bound
end
scan(KEYS[8], function(k, v)
  local e = at(k)
  e[2] = tonumber(v) or 0
  e[3] = redis.call('ZLEXCOUNT', KEYS[9], '[' .. k .. '\0', '(' .. k .. '\1')
end)
scan(KEYS[10], function(k, v)
  if string.sub(k, 1, 1) == '\0' then return end
  local n = tonumber(string.match(v, '^[^:]+:(%d+):') or '0') or 0
  if n > 0 then at(k)[4] = n end
end)
table.sort(list, function(a, b)
  local x, y = a[2] + a[3] + a[4], b[2] + b[3] + b[4]
  if x ~= y then return x > y end
  return a[1] < b[1]
end)
local keys = {}
for i = 1, math.min(#list, tonumber(ARGV[3])) do keys[#keys + 1] = list[i] end
local kdelayed = tonumber(redis.call('HGET', KEYS[10], '\0n') or '0') or 0
return {len, pending, consumers, lag, redis.call('ZCARD', KEYS[3]), redis.call('XLEN', KEYS[2]), dead, paused, backoff,
  redis.call('ZCARD', KEYS[9]), math.max(kdelayed, 0), keys}
