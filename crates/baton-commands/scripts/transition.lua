-- Transition: compare-and-set of a state on its version; the first terminal write wins.
-- KEYS[1..7] indexes (see lib.lua), KEYS[8] state hash,
-- KEYS[9] target queue stream (only for an atomic hand-off: same slot)
-- ARGV[1] expected version, ARGV[2] expected (old) status, ARGV[3] new status, ARGV[4] new JSON,
-- ARGV[5] TTL ms, ARGV[6] pub/sub channel, ARGV[7] id, ARGV[8] message JSON for KEYS[9]
-- Returns {'ok'}, {'missing'} or {'conflict', current JSON}.
local cur = redis.call('HMGET', KEYS[8], 'v', 's')
if not cur[1] then return { 'missing' } end
if cur[1] ~= ARGV[1] or cur[2] ~= ARGV[2] or TERMINAL[cur[2]] then
  return { 'conflict', redis.call('HGET', KEYS[8], 'd') }
end
local id, old, new, ttl = ARGV[7], ARGV[2], ARGV[3], tonumber(ARGV[5])
local version = tostring(tonumber(ARGV[1]) + 1)
redis.call('HSET', KEYS[8], 'v', version, 's', new, 'd', ARGV[4])
if old ~= new then
  local created = redis.call('HGET', KEYS[8], 'c')
  redis.call('ZREM', KEYS[STATUS_KEY[old]], id)
  redis.call('ZADD', KEYS[STATUS_KEY[new]], created, id)
end
local now = now_ms()
redis.call('PEXPIRE', KEYS[8], ttl)
redis.call('ZADD', KEYS[1], now + ttl, id)
if KEYS[9] then redis.call('XADD', KEYS[9], '*', 'p', ARGV[8]) end
redis.call('PUBLISH', ARGV[6], id .. ' ' .. new .. ' ' .. version)
return { 'ok' }
