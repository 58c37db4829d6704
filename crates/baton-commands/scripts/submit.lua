-- Submit: store a new state and enqueue its message, atomically; idempotent on id.
-- KEYS[1..7] indexes (see lib.lua), KEYS[8] state hash, KEYS[9] home queue stream,
-- KEYS[10] id -> queue lookup key (standalone only; on Cluster it is written before this script)
-- ARGV[1] state JSON, ARGV[2] canonical body, ARGV[3] created ms, ARGV[4] state TTL ms,
-- ARGV[5] message JSON, ARGV[6] id, ARGV[7] home queue, ARGV[8] lookup key TTL ms,
-- ARGV[9] the shortest lifetime a state of this store can have (min of state TTL and
-- retention, ms): its expiry score is now + that, a lower bound of every later expiry.
-- Returns {'created'}, {'existing', state JSON}, {'conflict'} or {'other_queue', its queue}.
local sha = redis.sha1hex(ARGV[2])
local b = redis.call('HGET', KEYS[8], 'b')
if b then
  if b == sha then return { 'existing', redis.call('HGET', KEYS[8], 'd') } end
  return { 'conflict' }
end
if KEYS[10] then
  -- One call: claim the lookup key unless it names another queue.
  local home = redis.call('SET', KEYS[10], ARGV[7], 'NX', 'GET', 'PX', ARGV[8])
  if home then
    if home ~= ARGV[7] then return { 'other_queue', home } end
    -- A lookup left by an expired state of this queue: refresh it.
    redis.call('SET', KEYS[10], ARGV[7], 'PX', ARGV[8])
  end
end
local now = now_ms()
prune(now, 20)
local id, ttl = ARGV[6], tonumber(ARGV[4])
redis.call('HSET', KEYS[8], 'v', '1', 's', 'SUBMITTED', 'c', ARGV[3], 'd', ARGV[1], 'b', sha)
redis.call('PEXPIRE', KEYS[8], ttl)
redis.call('ZADD', KEYS[2], ARGV[3], id)
redis.call('ZADD', KEYS[3], ARGV[3], id)
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[9]), id)
redis.call('XADD', KEYS[9], '*', 'p', ARGV[5])
return { 'created' }
