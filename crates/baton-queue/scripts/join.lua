-- Join: create the consumer group (with its stream) when missing, register this consumer (XGROUP
-- CREATECONSUMER, Redis 6.2+, so that it is counted before its first read) and write its first
-- liveness record, in server time.
-- KEYS[1] queue stream, KEYS[2] liveness hash (consumer -> `<ms of its last heartbeat>:<its
-- claim timeout ms>`), KEYS[3] fence hash (reclaim.lua)
-- ARGV[1] group, ARGV[2] consumer, ARGV[3] its claim timeout (ms)
-- A group created here (first use, or recreated after it was lost while the stream stayed)
-- delivers every entry anew with fence 0: fences of an earlier group are removed.
-- Returns 1.
local ok, err = pcall(redis.call, 'XGROUP', 'CREATE', KEYS[1], ARGV[1], '0', 'MKSTREAM')
if ok then
  redis.call('DEL', KEYS[3])
elseif not string.find(tostring(err), 'BUSYGROUP') then
  return redis.error_reply(tostring(err))
end
redis.call('XGROUP', 'CREATECONSUMER', KEYS[1], ARGV[1], ARGV[2])
local t = redis.call('TIME')
redis.call('HSET', KEYS[2], ARGV[2], (t[1] * 1000 + math.floor(t[2] / 1000)) .. ':' .. ARGV[3])
return 1
