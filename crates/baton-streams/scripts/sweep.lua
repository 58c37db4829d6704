-- Claims due members of one silence-deadline shard (no common prelude: one key, its own slot).
-- KEYS[1] = baton:s:deadlines:{N}; ARGV: 1 most members, 2 lease ms.
-- A member is "<incarnation> <path>", scored with the time (Redis clock, ms) its stream may turn
-- silent. Claimed members are re-scored now + lease, so concurrent sweepers (other processes)
-- skip them, and a sweeper that dies mid-way leaves them to be claimed again after the lease.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local due = redis.call('ZRANGE', KEYS[1], '-inf', string.format('%.0f', now), 'BYSCORE', 'LIMIT', 0, tonumber(ARGV[1]))
local lease = string.format('%.0f', now + tonumber(ARGV[2]))
for _, x in ipairs(due) do redis.call('ZADD', KEYS[1], lease, x) end
return due
