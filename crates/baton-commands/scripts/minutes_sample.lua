-- Samples a queue's depth and oldest age into this minute's slot of its per-minute aggregates
-- (src/minutes.rs), unless a process sampled this minute already.
-- KEYS[1..6] indexes (see lib.lua), KEYS[7] the per-minute aggregates hash.
-- Depth: the SUBMITTED index's size (after pruning expired entries, at most 1,000 looked at);
-- oldest age: now - the smallest created ms in it (0 when empty).
-- Returns 1 when this call sampled, 0 when the minute had its sample.
local now = now_ms()
local p = minute_slot(KEYS[7], now)
if redis.call('HEXISTS', KEYS[7], p .. 'q') == 1 then return 0 end
prune(now, 1000)
local depth = redis.call('ZCARD', KEYS[2])
local age = 0
local first = redis.call('ZRANGE', KEYS[2], 0, 0, 'WITHSCORES')
if first[2] then
  age = now - tonumber(first[2])
  if age < 0 then age = 0 end
end
redis.call('HSET', KEYS[7], p .. 'q', depth, p .. 'a', age)
return 1
