-- The webhook signing keys: creates the first key when there is none, or rotates.
-- KEYS[1] keys hash (kid -> key JSON, plus field 'current' -> kid), KEYS[2] registry version
-- counter (bumped on rotation, and when 'init' creates the first key, so every process reloads
-- the key ring: after Redis lost its data, processes still signing with the lost key must take
-- the new one, which a new process publishes in its JWKS).
-- ARGV[1] 'init' or 'rotate', ARGV[2] a new key's kid, ARGV[3] its JSON, ARGV[4] the current
-- key's JSON with retired_ms set, for 'rotate' (the caller read it just before; ARGV[5] its kid).
-- Returns the hash's contents (HGETALL) after the change.
local cur = redis.call('HGET', KEYS[1], 'current')
if ARGV[1] == 'init' then
  if not cur then
    redis.call('HSET', KEYS[1], ARGV[2], ARGV[3], 'current', ARGV[2])
    -- A version no process can hold already: at least the server's time in ms (versions count
    -- changes from 0, so they stay far below it), so a process whose cached version happens to
    -- equal a counter restarted from 0 after a data loss still sees a change.
    local t = redis.call('TIME')
    local ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
    local v = tonumber(redis.call('GET', KEYS[2]) or '0')
    if ms > v then
      redis.call('SET', KEYS[2], ms)
    else
      redis.call('INCR', KEYS[2])
    end
  end
elseif ARGV[1] == 'rotate' then
  if cur and cur == ARGV[5] then
    redis.call('HSET', KEYS[1], ARGV[5], ARGV[4])
  end
  redis.call('HSET', KEYS[1], ARGV[2], ARGV[3], 'current', ARGV[2])
  redis.call('INCR', KEYS[2])
end
return redis.call('HGETALL', KEYS[1])
