-- Join: create the consumer group (with its stream) when missing, register this consumer (XGROUP
-- CREATECONSUMER, Redis 6.2+, so that it is counted before its first read) and write its first
-- liveness record, in server time.
-- KEYS[1] queue stream, KEYS[2] liveness hash (consumer -> `<ms of its last heartbeat>:<its
-- claim timeout ms>`)
-- ARGV[1] group, ARGV[2] consumer, ARGV[3] its claim timeout (ms)
-- Returns 1.
local ok, err = pcall(redis.call, 'XGROUP', 'CREATE', KEYS[1], ARGV[1], '0', 'MKSTREAM')
if not ok and not string.find(tostring(err), 'BUSYGROUP') then return redis.error_reply(tostring(err)) end
redis.call('XGROUP', 'CREATECONSUMER', KEYS[1], ARGV[1], ARGV[2])
local t = redis.call('TIME')
redis.call('HSET', KEYS[2], ARGV[2], (t[1] * 1000 + math.floor(t[2] / 1000)) .. ':' .. ARGV[3])
return 1
