-- Shuts the queue's back-off gate (read.lua) for a while: a handler answered RateLimited(d).
-- KEYS[1] back-off (string; its time to live is the back-off left)
-- ARGV[1] the back-off, ms (≥ 1)
-- Only ever extends: a back-off in force that ends later is kept. Returns the back-off left, ms.
local d = tonumber(ARGV[1])
local left = redis.call('PTTL', KEYS[1])
if left >= d then return left end
redis.call('SET', KEYS[1], '1', 'PX', d)
return d
