-- Counts: exact number of live commands per status, after pruning expired index entries.
-- KEYS[1..6] indexes (see lib.lua). Returns {submitted, running, succeeded, failed, cancelled}.
prune(now_ms(), 100000)
local out = {}
for k = 2, 6 do out[#out + 1] = redis.call('ZCARD', KEYS[k]) end
return out
