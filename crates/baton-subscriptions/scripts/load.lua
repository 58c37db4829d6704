-- Reads one subscription and the server's clock.
-- KEYS[1] the subscription's state hash (fields v: version, s: record JSON, '' once deleted).
-- Returns {version, record JSON or '', seconds, microseconds}.
local r = redis.call('HMGET', KEYS[1], 'v', 's')
local t = redis.call('TIME')
return { r[1] or '0', r[2] or '', t[1], t[2] }
