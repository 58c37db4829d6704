-- Stores one subscription if nobody changed it since it was read (compare-and-set on its
-- version), and in the same step updates the registry and enqueues a delivery message.
-- KEYS[1] state hash, KEYS[2] registry hash (id -> entry JSON), KEYS[3] registry version
-- counter, KEYS[4] the delivery queue's stream (all under the queue's hash tag).
-- ARGV[1] expected version, ARGV[2] record JSON ('' deletes: a tombstone keeps the version for a
-- day, so a re-created id never repeats a version), ARGV[3] registry op ('', 'put', 'del'),
-- ARGV[4] registry entry JSON, ARGV[5] delivery payload ('' none), ARGV[6] id, ARGV[7] the
-- queue entry's payload field (baton_queue::keys::PAYLOAD_FIELD).
-- Returns 1 when stored, 0 on a version conflict.
local v = tonumber(redis.call('HGET', KEYS[1], 'v') or '0')
if v ~= tonumber(ARGV[1]) then return 0 end
redis.call('HSET', KEYS[1], 'v', v + 1, 's', ARGV[2])
if ARGV[2] == '' then
  redis.call('PEXPIRE', KEYS[1], 86400000)
else
  redis.call('PERSIST', KEYS[1])
end
if ARGV[3] == 'put' then
  redis.call('HSET', KEYS[2], ARGV[6], ARGV[4])
  redis.call('INCR', KEYS[3])
elseif ARGV[3] == 'del' then
  redis.call('HDEL', KEYS[2], ARGV[6])
  redis.call('INCR', KEYS[3])
end
if ARGV[5] ~= '' then
  redis.call('XADD', KEYS[4], '*', ARGV[7], ARGV[5])
end
return 1
