-- Reads one cron schedule's record (see schedules.rs) with the clock of the Redis node that
-- holds it, so every process decides due times by one clock.
-- KEYS[1] the record. Returns {record JSON or '' when absent, the node's time in ms}.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
return { redis.call('GET', KEYS[1]) or '', now }
