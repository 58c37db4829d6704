-- Transition: compare-and-set of a state on its version; the first terminal write wins.
-- KEYS[1..6] indexes (see lib.lua), KEYS[7] state key,
-- KEYS[8] target queue stream (only with ARGV[8]: an atomic hand-off, same slot),
-- KEYS[#KEYS] the stream of the delivery to ack (only with ARGV[9]; same slot).
-- ARGV[1] expected version, ARGV[2] expected (old) status, ARGV[3] new status, ARGV[4] new JSON,
-- ARGV[5] TTL ms, ARGV[6] pub/sub channel, ARGV[7] id, ARGV[8] message JSON for KEYS[8] or '',
-- ARGV[9] entry id to ack or '', ARGV[10] its group, ARGV[11] '1' when ARGV[5] may be shorter
-- than the lifetime the expiry score assumed (the score is then lowered), ARGV[12] origin tag
-- of the writing process.
-- The ack needs no owner check: the version compare-and-set already decided that this write is
-- the command's next step, and dispatch reads the state, so a delivery of this message held by
-- another consumer has nothing left to do.
-- Returns {'ok', acked 0/1}, {'missing'} or {'conflict', current JSON}.
local cur = redis.call('GET', KEYS[7])
if not cur then return { 'missing' } end
local v, s, c, b, at = header(cur)
if v ~= ARGV[1] or s ~= ARGV[2] or TERMINAL[s] then
  return { 'conflict', string.sub(cur, at) }
end
local id, old, new, ttl = ARGV[7], ARGV[2], ARGV[3], tonumber(ARGV[5])
local version = tostring(tonumber(v) + 1)
redis.call('SET', KEYS[7], version .. ' ' .. new .. ' ' .. c .. ' ' .. b .. ' ' .. ARGV[4], 'PX', ARGV[5])
if old ~= new then
  redis.call('ZREM', KEYS[STATUS_KEY[old]], id)
  redis.call('ZADD', KEYS[STATUS_KEY[new]], c, id)
end
-- Keep the expiry score a lower bound (see lib.lua): only ever lowered.
if ARGV[11] == '1' then redis.call('ZADD', KEYS[1], 'LT', now_ms() + ttl, id) end
if ARGV[8] ~= '' then redis.call('XADD', KEYS[8], '*', 'p', ARGV[8]) end
local acked = 0
if ARGV[9] ~= '' then
  local stream, mid = KEYS[#KEYS], ARGV[9]
  acked = redis.call('XACK', stream, ARGV[10], mid)
  if acked == 1 then redis.call('XDEL', stream, mid) end
end
-- Only terminal states are announced: waiters wait for one, and a cancel is one.
if TERMINAL[new] then
  redis.call('PUBLISH', ARGV[6], id .. ' ' .. new .. ' ' .. version .. ' ' .. ARGV[12])
end
return { 'ok', acked }
