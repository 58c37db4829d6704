-- Reap: remove consumers of the group that own no pending entry and are not alive by Baton's own
-- heartbeat: their liveness record is at least the window old (a consumer without a record, not
-- written by a Baton consumer, when XINFO says it has been idle that long). XINFO's idle time is
-- not used for Baton consumers: on Redis 7.0 a blocking read on an empty stream does not refresh
-- it. The pending check is atomic with the removal, so a consumer that just took an entry is never
-- removed with it. Liveness records of consumers no longer in the group and older than the window
-- are deleted too (fields starting with `~` are the queue's own stamps, see reclaim.lua).
-- KEYS[1] queue stream, KEYS[2] liveness hash
-- ARGV[1] group, ARGV[2] this consumer (never removed), ARGV[3] the parked owner (removed when it
-- owns nothing), ARGV[4] window (ms)
-- Returns how many consumers were removed.
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
local window = tonumber(ARGV[4])
local n, present = 0, {}
for _, c in ipairs(redis.call('XINFO', 'CONSUMERS', KEYS[1], ARGV[1])) do
  local m = {}
  for i = 1, #c, 2 do m[c[i]] = c[i + 1] end
  local name = m['name']
  present[name] = true
  if name == ARGV[3] and tonumber(m['pending']) == 0 then
    -- The parked owner holds nothing: remove it (XCLAIM creates it again when needed).
    redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], name)
  elseif name ~= ARGV[2] and name ~= ARGV[3] and tonumber(m['pending']) == 0 then
    local rec = redis.call('HGET', KEYS[2], name)
    local dead
    if rec then
      -- `<ms>:<its claim timeout ms>`: never within twice its own claim timeout either.
      local a, b = string.match(rec, '^(%d+):?(%d*)$')
      local w = window
      if b and b ~= '' then w = math.max(window, 2 * tonumber(b)) end
      dead = now - (tonumber(a) or 0) >= w
    else
      dead = tonumber(m['idle']) >= window
    end
    if dead then
      redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], name)
      redis.call('HDEL', KEYS[2], name)
      n = n + 1
    end
  end
end
local records = redis.call('HGETALL', KEYS[2])
for i = 1, #records, 2 do
  local seen = tonumber(string.match(records[i + 1], '^(%d+)') or '0')
  if string.sub(records[i], 1, 1) ~= '~' and not present[records[i]] and now - seen >= window then
    redis.call('HDEL', KEYS[2], records[i])
  end
end
return n
