-- Transition: compare-and-set of a state on its version; the first terminal write wins.
-- KEYS[1..7] indexes (see lib.lua), KEYS[8] state hash,
-- KEYS[9] target queue stream (only with ARGV[8]: an atomic hand-off, same slot),
-- KEYS[#KEYS] the stream of the delivery to ack (only with ARGV[9]; same slot).
-- ARGV[1] expected version, ARGV[2] expected (old) status, ARGV[3] new status, ARGV[4] new JSON,
-- ARGV[5] TTL ms, ARGV[6] pub/sub channel, ARGV[7] id, ARGV[8] message JSON for KEYS[9] or '',
-- ARGV[9] entry id to ack or '', ARGV[10] its group, ARGV[11] its consumer (the owner an ack
-- requires, as in baton-queue's ack script), ARGV[12] origin tag of the writing process.
-- Returns {'ok', acked 0/1}, {'missing'} or {'conflict', current JSON}.
local cur = redis.call('HMGET', KEYS[8], 'v', 's', 'c')
if not cur[1] then return { 'missing' } end
if cur[1] ~= ARGV[1] or cur[2] ~= ARGV[2] or TERMINAL[cur[2]] then
  return { 'conflict', redis.call('HGET', KEYS[8], 'd') }
end
local id, old, new, ttl = ARGV[7], ARGV[2], ARGV[3], tonumber(ARGV[5])
local version = tostring(tonumber(ARGV[1]) + 1)
redis.call('HSET', KEYS[8], 'v', version, 's', new, 'd', ARGV[4])
if old ~= new then
  redis.call('ZREM', KEYS[STATUS_KEY[old]], id)
  redis.call('ZADD', KEYS[STATUS_KEY[new]], cur[3], id)
end
local now = now_ms()
redis.call('PEXPIRE', KEYS[8], ttl)
-- Keep the expiry score a lower bound (see lib.lua): only ever lowered.
redis.call('ZADD', KEYS[1], 'LT', now + ttl, id)
if ARGV[8] ~= '' then redis.call('XADD', KEYS[9], '*', 'p', ARGV[8]) end
local acked = 0
if ARGV[9] ~= '' then
  local stream, mid = KEYS[#KEYS], ARGV[9]
  local p = redis.call('XPENDING', stream, ARGV[10], mid, mid, 1)
  if p[1] and p[1][2] == ARGV[11] then
    redis.call('XACK', stream, ARGV[10], mid)
    redis.call('XDEL', stream, mid)
    acked = 1
  end
end
-- Only terminal states are announced: waiters wait for one, and a cancel is one.
if TERMINAL[new] then
  redis.call('PUBLISH', ARGV[6], id .. ' ' .. new .. ' ' .. version .. ' ' .. ARGV[12])
end
return { 'ok', acked }
