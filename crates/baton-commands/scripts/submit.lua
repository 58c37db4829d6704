-- Submit: store a new state and enqueue its message, atomically; idempotent on id.
-- KEYS[1] expiry zset, KEYS[2] SUBMITTED index (see lib.lua), KEYS[3] state key,
-- KEYS[4] home queue stream, KEYS[5] id -> queue lookup key (standalone only; on Cluster it
-- is written before this script)
-- ARGV[1] stored state (header and JSON, see lib.lua), ARGV[2] its body sha1, ARGV[3] created
-- ms, ARGV[4] state TTL ms, ARGV[5] message JSON, ARGV[6] id, ARGV[7] home queue, ARGV[8]
-- lookup key TTL ms, ARGV[9] the shortest lifetime a state of this store can have (min of
-- state TTL and retention, ms): its expiry score is now + that, a lower bound of every later
-- expiry.
-- Returns {'created'}, {'existing', stored state}, {'conflict'} or {'other_queue', its queue}.
-- One call: create unless present, else read what is there.
local prior = redis.call('SET', KEYS[3], ARGV[1], 'NX', 'GET', 'PX', ARGV[4])
if prior then
  local _, _, _, b = header(prior)
  if b == ARGV[2] then return { 'existing', prior } end
  return { 'conflict' }
end
if KEYS[5] then
  -- One call: claim the lookup key unless it names another queue.
  local home = redis.call('SET', KEYS[5], ARGV[7], 'NX', 'GET', 'PX', ARGV[8])
  if home then
    if home ~= ARGV[7] then
      redis.call('DEL', KEYS[3])
      return { 'other_queue', home }
    end
    -- A lookup left by an expired state of this queue: refresh it.
    redis.call('SET', KEYS[5], ARGV[7], 'PX', ARGV[8])
  end
end
local id = ARGV[6]
local mid = redis.call('XADD', KEYS[4], '*', 'p', ARGV[5])
-- The entry id's milliseconds are the server's clock (never behind the stream's last entry).
local now = tonumber(string.match(mid, '^(%d+)'))
redis.call('ZADD', KEYS[2], ARGV[3], id)
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[9]), id)
return { 'created' }
